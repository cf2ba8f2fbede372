"""A ResNet block's statistics round over Flower records: the piece and the identity stream's
statistics travel both ways, and a reply without them is named."""

from __future__ import annotations

import pytest
import torch

from fedfuse.clients.records import (
    STATISTICS_KEY,
    pack_statistics,
    pack_statistics_request,
    unpack_statistics,
    unpack_statistics_request,
)
from fedfuse.fusion.statistics.on_site import site_statistics
from fedfuse.fusion.statistics.rounds import SiteStatistics, StatisticsRequest
from fedfuse.models import build_model, make_spec
from tests.helpers import randn

RESNET = make_spec("resnet", (1, 12, 12), 4, depth=10, width_multiplier=1 / 16)


def _round_trip() -> tuple[SiteStatistics, SiteStatistics, StatisticsRequest]:
    model, fused = build_model(RESNET, seed=0).eval(), build_model(RESNET, seed=1).eval()
    content = pack_statistics_request(StatisticsRequest(1, fused, dtype="float64", piece=1), model)
    request, own = unpack_statistics_request(content)
    assert (request.level, request.piece, request.linear_piece.name) == (1, 1, "conv2")
    sent = site_statistics(own, randn(0, 6, *RESNET.input_shape), request, device="cpu")
    return sent, unpack_statistics(pack_statistics(sent), source="client 1"), request


def test_a_block_piece_and_its_stream_statistics_travel_in_flower_records():
    sent, received, request = _round_trip()
    assert received.piece == 1 and set(SiteStatistics.STREAM_TENSORS) <= set(sent.tensors())
    for name, tensor in sent.tensors().items():
        assert torch.equal(getattr(received, name), tensor), name
    level = request.fused.levels[1]
    piece = request.linear_piece
    received.check(piece.fan_in(level), 4, source="client 1", stream_width=piece.width(level))


def test_a_reply_without_the_stream_statistics_is_named():
    sent, _, request = _round_trip()
    content = pack_statistics(sent)
    tensors = dict(content.array_records[STATISTICS_KEY].to_torch_state_dict())
    del tensors["stream_norms"]
    content.array_records[STATISTICS_KEY] = type(content.array_records[STATISTICS_KEY])(tensors)
    received = unpack_statistics(content, source="client 1")
    level, piece = request.fused.levels[1], request.linear_piece
    with pytest.raises(ValueError, match="client 1: statistic 'stream_norms' is not a float"):
        received.check(piece.fan_in(level), 4, source="client 1", stream_width=piece.width(level))
