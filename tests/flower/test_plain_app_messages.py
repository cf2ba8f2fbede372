"""What a plain Flower app's author reads when the strategy is misused: each message names the
knob of the plain app (``model_fn=Net``, ``fusion_set=``), not fedfuse's own app's."""

from __future__ import annotations

import pytest

from fedfuse.experiments.plain_models import TemplateNet
from fedfuse.strategies import MethodsUnfit, OneShotFusion
from fedfuse.strategies.preflight import check_methods


def test_a_model_instance_as_model_fn_says_to_pass_the_class(tmp_path):
    with pytest.raises(TypeError) as error:
        OneShotFusion("fedavg", model_fn=TemplateNet(), input_shape=(1, 28, 28), store=tmp_path)
    message = str(error.value)
    assert "model_fn is a TemplateNet instance" in message
    assert "model_fn=TemplateNet" in message and "zero-argument function" in message


def test_a_missing_fusion_set_names_the_fusion_set_argument(tmp_path):
    with pytest.raises(MethodsUnfit) as error:
        OneShotFusion("kf-linear", model_fn=TemplateNet, input_shape=(1, 28, 28), store=tmp_path)
    message = str(error.value)
    assert "fusion_set=" in message and "DataLoader" in message
    assert "run config" not in message and "fusion-data" not in message


def test_fedfuse_s_own_app_still_names_its_run_config(tmp_path):
    strategy = OneShotFusion("kf-linear", available_inputs={"scores"}, store=tmp_path)
    with pytest.raises(MethodsUnfit, match="run config fusion-data"):
        check_methods(strategy.methods, 2, None, strategy.available_inputs)
