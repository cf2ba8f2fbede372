"""ResNet/ViT and the fused width as run settings: keys, specs, checks before training."""

import pytest

from fedfuse.federation.site_cache import site_set_key
from fedfuse.fusion import make_fusion_method
from fedfuse.models import make_spec
from fedfuse.settings.run import RunSettings
from fedfuse.strategies.preflight import MethodsUnfit, check_methods


def test_model_options_build_resnet_and_vit_specs():
    settings = RunSettings.from_config(
        {"model": "resnet", "model-options": "depth=18 width_multiplier=0.125"}
    )
    spec = make_spec("resnet", (1, 28, 28), 10, **settings.architecture_options())
    assert spec.options["blocks"] == [2, 2, 2, 2] and spec.widths[0] == 8
    vit = RunSettings(model="vit", model_options="patch=7 depth=2 heads=2 hidden=16 mlp=32")
    assert vit.architecture_options() == {
        "patch": 7,
        "depth": 2,
        "heads": 2,
        "hidden": 16,
        "mlp": 32,
    }
    with pytest.raises(ValueError, match="resnet: .*unexpected keyword"):
        make_spec(
            "resnet", (1, 28, 28), 10, **RunSettings(model_options="deep=3").architecture_options()
        )
    # site sets of different model options never share a cache entry
    assert site_set_key(RunSettings(model="resnet", model_options="depth=10"), 2) != site_set_key(
        RunSettings(model="resnet", model_options="depth=18"), 2
    )


def test_fused_widths_key_scales_or_lists_the_widths():
    spec = make_spec("resnet", (1, 28, 28), 10, depth=10, width_multiplier=0.25)
    assert RunSettings().fused_spec(spec) is None
    assert RunSettings(fused_widths="0.5x").fused_spec(spec).widths == (8, 8, 16, 32, 64)
    assert RunSettings(fused_widths="4,4,8,8,8").fused_spec(spec).widths == (4, 4, 8, 8, 8)
    assert RunSettings(fused_widths="1x").fused_spec(spec) is None
    assert RunSettings(fused_widths="1x").widths_label() == RunSettings().widths_label() == ""
    assert RunSettings(fused_widths="1.5x").widths_label() == "widths(1.5x)"
    with pytest.raises(ValueError, match="fused-widths '4,4' does not fit the sites' resnet"):
        RunSettings(fused_widths="4,4").fused_spec(spec)
    vit = make_spec("vit", (1, 28, 28), 10, patch=7, depth=2, heads=4, hidden=32, mlp=48)
    with pytest.raises(ValueError, match="heads do not divide"):
        RunSettings(fused_widths="0.3x").fused_spec(vit)


def test_a_fused_width_is_checked_against_every_method_before_training():
    spec = make_spec("resnet", (1, 28, 28), 10, depth=10, width_multiplier=0.25)
    target = RunSettings(fused_widths="0.5x").fused_spec(spec)
    methods = [make_fusion_method(name) for name in ("kf-gradient", "fedavg", "git-rebasin")]
    with pytest.raises(MethodsUnfit, match="2 of the listed") as error:
        check_methods(methods, 2, spec, None, target)
    assert "fedavg: fuses only into the sites' own architecture" in str(error.value)
    check_methods(methods[:1], 2, spec, None, target)  # kf-gradient fuses into any width


@pytest.mark.parametrize("name", ["hf-linear", "hf-gradient", "hf-sites", "hf-trust"])
def test_hungarian_variants_refuse_another_width_before_training(name):
    spec = make_spec("vit", (1, 28, 28), 10, patch=7, depth=2, heads=4, hidden=32, mlp=48)
    target = RunSettings(fused_widths="2x").fused_spec(spec)
    with pytest.raises(MethodsUnfit, match=f"{name}: Hungarian grouping matches .* one-to-one"):
        check_methods([make_fusion_method(name)], 2, spec, None, target)
    kmeans = make_fusion_method("k" + name[1:])
    check_methods([kmeans], 2, spec, None, target)  # K-means grouping fuses into any width
    check_methods([make_fusion_method(name)], 2, spec, None, None)


def test_methods_that_start_from_a_site_model_refuse_another_width_before_training():
    spec = make_spec("mlp", (1, 8, 8), 10, widths=(16, 16))
    target = spec.with_widths((8, 8))
    with pytest.raises(ValueError, match=r"kd: student_init='first' .* use student_init='fresh'"):
        make_fusion_method("kd").check_run(2, spec, target=target)
    with pytest.raises(ValueError, match="linear-probe: the probe keeps a site's body"):
        make_fusion_method("linear-probe").check_run(2, spec, target=target)
    make_fusion_method("kd", student_init="fresh").check_run(2, spec, target=target)
