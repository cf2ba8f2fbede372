"""The plain-model benchmark end to end on a small real subset: sites train the Flower template
CNN, every listed method fuses the plain ``Net``s, and the rows compare them with the sites."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from fedfuse.data import DatasetNotFoundError, load_dataset
from fedfuse.experiments import plain_models
from fedfuse.experiments.user_models import GREY_28, OWN_SPECS, USER_MODELS, as_fedfuse_model


@pytest.fixture(scope="module")
def fashion():
    try:
        train, test = load_dataset("fashion-mnist", "train"), load_dataset("fashion-mnist", "test")
    except DatasetNotFoundError:
        pytest.skip("Fashion-MNIST is not installed (setup.sh installs it)")
    rng = np.random.default_rng(0)
    return (
        train.subset(np.sort(rng.choice(len(train), 1500, replace=False))),
        test.subset(np.arange(500)),
    )


def _seed_0(fashion, **options) -> dict[str, dict[str, float]]:
    """Seed 0 of the benchmark on the subsets: sharded sites, 1 epoch, 60 fusion rows."""
    train, test = fashion
    options = {"partitioner": "sharded", "epochs": 1, "fusion_samples": 60, **options}
    return plain_models.run_seed(0, train_set=train, test_set=test, **options)


def test_three_sites_fuse_the_template_cnn_with_every_method_that_takes_it(fashion):
    methods = ("fedavg", "hf-linear", "git-rebasin", "kf-linear", "regmean")
    row = _seed_0(fashion, sites=3, methods=methods)
    # every method fuses 3 sites (hf-linear and git-rebasin by iterative matching)
    assert list(row) == [
        "best site",
        "ensemble",
        "fedavg",
        "hf-linear",
        "git-rebasin",
        "kf-linear",
        "regmean",
    ]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in row.values())
    assert all(
        r["seconds"] >= 0 for name, r in row.items() if name not in ("best site", "ensemble")
    )
    table = plain_models.summarise([row, row]).splitlines()
    assert table[2].startswith("| best site |") and "± 0.00" in table[2]


#: ResNet-18's widest convs (4608 inputs) cost seconds per closed-form fit: one such method
TORCHVISION_CASES = {
    "resnet18": (("fedavg", "kf-sites"), False),
    "vit": (("fedavg", "kf-linear", "kf-sites"), True),
}


@pytest.mark.parametrize("model", sorted(TORCHVISION_CASES))
def test_torchvision_models_trained_on_sites_are_fused_beside_fedfuse_s_own(fashion, model):
    """The worked examples through the library: torchvision's ResNet-18 and a small
    VisionTransformer, trained on 2 sharded sites, fused by statistics rounds on the sites' data
    (and the ViT by the closed-form fit on the fusion set, beside fedfuse's own ViT trained and
    fused alike)."""
    methods, own = TORCHVISION_CASES[model]
    row = _seed_0(fashion, sites=2, methods=methods, model=model, own=own, train_samples=120)
    names = ["best site", "ensemble", *methods]
    assert list(row) == names + ([f"own {name}" for name in names] if own else [])
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in row.values())
    # sharded sites know disjoint classes: fitting the fused model beats averaging weights
    assert row["kf-sites"]["accuracy"] > row["fedavg"]["accuracy"]


def test_a_shared_start_trains_fedfuses_resnet_as_torchvisions_to_the_same_sites(fashion):
    """``own_start="shared"``: fedfuse's ResNet-18 starts from the torchvision site's initial
    weights, trains with the same recipe to the same function, and averages to the same model;
    from independent starts the sites differ."""
    methods = ("fedavg",)
    options = {"sites": 2, "methods": methods, "model": "resnet18", "own": True}
    shared = _seed_0(fashion, own_start="shared", train_samples=60, **options)
    for name in ("best site", "ensemble", *methods):
        expected = shared[name]["accuracy"]
        assert shared[f"own {name}"]["accuracy"] == pytest.approx(expected, abs=4e-3)
    independent = _seed_0(fashion, own_start="independent", train_samples=60, **options)
    gaps = [
        abs(independent[f"own {name}"]["accuracy"] - independent[name]["accuracy"])
        for name in ("best site", "ensemble", *methods)
    ]
    assert max(gaps) > 4e-3
    copied = _seed_0(fashion, own_start="copied", train_samples=60, **options)
    assert copied["own best site"] == copied["best site"]  # the trained sites, not retrained
    assert copied["own fedavg"]["accuracy"] == copied["fedavg"]["accuracy"]
    with pytest.raises(ValueError, match="own_start must be one of"):
        _seed_0(fashion, own_start="same", **options)


def test_gaussian_samples_complete_the_fusion_set_of_the_methods_that_read_one(fashion, caplog):
    """``gaussian_samples``: each site fits its class Gaussians and the server draws that many
    rows per site into its fusion set, for a method that reads one; RegMean reads Grams only,
    so nothing is fitted or drawn for it."""
    with caplog.at_level("INFO", logger="fedfuse.fusion.statistics.class_gaussians"):
        row = _seed_0(fashion, sites=2, methods=("kf-trust",), gaussian_samples=30)
    assert 0.0 <= row["kf-trust"]["accuracy"] <= 1.0
    assert "fusion set completed with 30 Gaussian rows per site (2 sites)" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="fedfuse.fusion.statistics.class_gaussians"):
        _seed_0(fashion, sites=2, methods=("regmean",), gaussian_samples=30)
    assert "Gaussian rows" not in caplog.text


def test_methods_are_named_as_compare_names_them_packaged_configs_included():
    refine = plain_models.named_method("kf-gradient-refine")  # configs/method/kf-gradient-refine
    assert (refine.name, refine.options()["preset"], refine.options()["start"]) == (
        "kf-gradient",
        "refine",
        "closed-form",
    )
    assert plain_models.named_method("kf-gradient").options()["preset"] != "refine"
    with pytest.raises(ValueError, match="unknown fusion method 'kf-nothing'; known: "):
        plain_models.named_method("kf-nothing")


@pytest.mark.parametrize("name", ["resnet18", "vit"])
def test_torchvisions_weights_copied_into_fedfuses_architecture_compute_the_same_function(name):
    torch.manual_seed(0)
    model = USER_MODELS[name]()
    with torch.no_grad():  # non-trivial norms, statistics and head (torchvision zeroes the ViT's)
        for module in model.modules():
            if isinstance(module, (nn.BatchNorm2d, nn.LayerNorm)):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.1)
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.1)
                module.running_var.uniform_(0.5, 2.0)
            if isinstance(module, nn.Linear):
                module.weight.normal_(0, 0.1)
    own = as_fedfuse_model(model.eval(), OWN_SPECS[name])
    x = torch.randn(8, *GREY_28)
    with torch.no_grad():
        expected = model(x)
        assert torch.allclose(own(x), expected, atol=1e-4 * float(expected.abs().max()) + 1e-6)
    assert any(not torch.equal(p, 0 * p) for p in model.parameters())


def test_a_model_of_another_shape_is_not_copied_into_fedfuses_architecture():
    with pytest.raises(ValueError, match="does not fit fedfuse's"):
        as_fedfuse_model(torchvision.models.resnet34(num_classes=10), OWN_SPECS["resnet18"])
    with pytest.raises(TypeError, match="got TemplateNet"):
        as_fedfuse_model(USER_MODELS["template"](), OWN_SPECS["resnet18"])
