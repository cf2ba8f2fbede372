"""The upload request on the wire: the train message and the check before training carry it as
one unit, and a message that lacks a key of it is refused with an error naming the key (a site
never rebuilds the server's methods to fill it in)."""

from __future__ import annotations

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedfuse.clients.client_app import check_contract, train_and_upload
from fedfuse.clients.records import (
    CONFIG_KEY,
    NO_UPLOAD_KEY,
    SEND_GRAMS_KEY,
    UPLOAD_REQUEST_KEYS,
    pack_contract_query,
    pack_train_request,
    unpack_contract_query,
    unpack_train_request,
)
from fedfuse.federation.contract import DataContract
from fedfuse.federation.upload_request import UploadRequest
from tests.helpers import quick_site_settings

pytestmark = pytest.mark.usefixtures("task_identity")

ASKED = UploadRequest(grams=True, fisher=("diagonal", "kfac"), gaussian_rank=4, rounds="rounds")
SETTINGS = quick_site_settings(methods="regmean,fedavg")


def _train_message(request: UploadRequest = ASKED) -> RecordDict:
    return pack_train_request(ArrayRecord(), ConfigRecord(), request=request)


def test_the_train_message_carries_the_request_as_one_unit():
    assert unpack_train_request(_train_message()).upload == ASKED
    assert unpack_train_request(_train_message(UploadRequest())).upload == UploadRequest()
    contract = DataContract(input_shape=(1, 8, 8), num_classes=10)
    assert unpack_contract_query(pack_contract_query(contract, ASKED)) == (contract, ASKED)


@pytest.mark.parametrize("key", UPLOAD_REQUEST_KEYS)
def test_a_train_message_lacking_a_key_of_the_request_is_refused_naming_it(key):
    content = _train_message()
    del content.config_records[CONFIG_KEY][key]
    with pytest.raises(ValueError, match=f"the train message lacks '{key}'"):
        unpack_train_request(content)


def test_a_malformed_value_is_refused_naming_its_key():
    content = _train_message()
    content.config_records[CONFIG_KEY][SEND_GRAMS_KEY] = 1
    with pytest.raises(ValueError, match="send-grams=1 must be true or false"):
        unpack_train_request(content)
    content = _train_message()
    content.config_records[CONFIG_KEY]["send-fisher"] = "diagonal,hessian"
    with pytest.raises(ValueError, match=r"unknown Fisher kinds \['hessian'\] \(send-fisher\)"):
        unpack_train_request(content)


def _site_reply(handler, content: RecordDict, message_type: str) -> ConfigRecord:
    msg = Message(content=content, message_type=message_type, dst_node_id=5)
    node_config = {"partition-id": 0, "num-partitions": 2, "site-name": "hospital-0"}
    context = Context(1, 5, node_config, RecordDict(), SETTINGS.to_config())
    return handler(msg, context).content.config_records[NO_UPLOAD_KEY]


def test_the_client_app_refuses_a_train_message_without_the_request_before_training(trained):
    content = _train_message()
    del content.config_records[CONFIG_KEY][SEND_GRAMS_KEY]
    answer = _site_reply(train_and_upload, content, MessageType.TRAIN)
    assert answer["kind"] == "failed" and "lacks 'send-grams'" in str(answer["reason"])
    assert trained == []  # nothing was trained for a message the site cannot read


def test_the_check_before_training_without_the_request_is_refused_naming_the_key():
    content = pack_contract_query(DataContract(input_shape=(1, 8, 8), num_classes=10), ASKED)
    del content.config_records[CONFIG_KEY]["statistics-rounds"]
    answer = _site_reply(check_contract, content, "query.contract")
    assert "the server's check lacks 'statistics-rounds'" in str(answer["reason"])
