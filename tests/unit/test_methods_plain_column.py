"""``fedfuse methods`` has a column for the user's own model with residuals and normalisation,
answered by each method's own pre-training check on an adapted BatchNorm + residual CNN."""

from __future__ import annotations

from fedfuse.cli.methods import PLAIN_RESIDUAL, architectures, describe
from fedfuse.fusion import make_fusion_method


def test_the_residual_norm_column_says_which_methods_take_such_a_model():
    specs = {PLAIN_RESIDUAL: architectures()[PLAIN_RESIDUAL]}
    accepts = {
        name: describe(make_fusion_method(name), specs)["accepts"][PLAIN_RESIDUAL]
        for name in ("fedavg", "git-rebasin", "kd", "kf-linear", "hf-linear", "regmean")
    }
    assert accepts["fedavg"] == accepts["git-rebasin"] == accepts["kd"] == "yes"
    assert accepts["regmean"] == "yes"  # Linear/Conv2d by their Grams, BatchNorm averaged
    # a conv with its BatchNorm and a residual block, fitted piece by piece in closed form
    assert accepts["kf-linear"] == accepts["hf-linear"] == "yes"
