"""The rule every ``"auto"`` option chooses by (:mod:`fedfuse.fusion.blocks.selection`): of the
candidates in order of preference, the first whose fusion-set accuracy no other's is
significantly above (a paired standard error), whatever their losses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfuse.fusion import FusionInputs
from fedfuse.fusion.blocks.selection import (
    best_on_fusion_set,
    fuse_with_option,
    fusion_set_scores,
    preferred_first,
    significantly_below,
)

#: twenty rows: labels 0 on rows 0-15, 1 on rows 16-19
ROWS = 20
INPUTS = FusionInputs(data=torch.eye(ROWS), labels=(torch.arange(ROWS) >= 16).long())


def _model(right: int, confident: bool) -> nn.Linear:
    """A linear model right on the first ``right`` rows (logit margin 10 if ``confident``,
    else 0.1) and wrong on the others (margin 10 or 0.1)."""
    margin = 10.0 if confident else 0.1
    model = nn.Linear(ROWS, 2, bias=False)
    with torch.no_grad():
        model.weight.zero_()
        for row, label in enumerate(INPUTS.labels.tolist()):
            predicted = label if row < right else 1 - label
            model.weight[predicted, row] = margin
    return model


def test_scores_are_the_accuracy_and_the_mean_cross_entropy():
    model = _model(15, True)
    accuracy, loss = fusion_set_scores(model, INPUTS)
    logits = model(INPUTS.data)
    assert accuracy == 0.75
    assert loss == pytest.approx(nn.functional.cross_entropy(logits, INPUTS.labels).item())


def test_a_significantly_more_accurate_candidate_wins_over_a_lower_loss():
    flat, confident = _model(8, False), _model(18, True)  # 8 vs 18 right: 10 > sqrt(10)
    chosen = best_on_fusion_set(
        iter([("flat", (flat, {})), ("confident", (confident, {}))]), INPUTS
    )
    assert chosen.losses["flat"] < chosen.losses["confident"]  # the loss would keep flat
    assert chosen.key == "confident"
    assert chosen.accuracies == {"flat": 0.4, "confident": 0.9}


def test_the_preferred_candidate_stays_within_a_standard_error():
    # 14 vs 16 right (2 < sqrt(2)? no: 2 > 1.41, so 16 wins); 15 vs 16: 1 < 1 is false
    assert significantly_below(torch.arange(ROWS) < 14, torch.arange(ROWS) < 16)
    assert not significantly_below(torch.arange(ROWS) < 15, torch.arange(ROWS) < 16)
    near = [("preferred", (_model(15, True), {})), ("better", (_model(16, False), {}))]
    assert best_on_fusion_set(near, INPUTS).key == "preferred"
    far = [("preferred", (_model(10, True), {})), ("better", (_model(16, False), {}))]
    assert best_on_fusion_set(far, INPUTS).key == "better"
    with pytest.raises(ValueError, match="no candidate"):
        best_on_fusion_set([], INPUTS)


def test_auto_option_prefers_the_unlabelled_value_and_reports_every_value():
    assert preferred_first((1e-4, 1e-2, 1.0), 1e-2) == [1e-2, 1e-4, 1.0]
    models = {0.0: _model(8, False), 0.5: _model(9, True), 1.0: _model(18, True)}

    def choose(inputs):
        fuse = lambda v: (models[v], {"damping": v})  # noqa: E731
        return fuse_with_option(
            "m", "damping", "auto", fuse, grid=(0.0, 1.0), unlabelled=0.5, inputs=inputs
        )

    fused = choose(INPUTS)
    assert fused[1]["damping"] == 1.0
    assert fused[1]["fusion_set_accuracies"] == {"0.5": 0.45, "0.0": 0.4, "1.0": 0.9}
    assert choose(FusionInputs(data=INPUTS.data))[1] == {"damping": 0.5}  # without labels
