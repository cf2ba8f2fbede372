"""Config errors end fast, in at most two lines naming the key and what is allowed (issue 24):
fusion options in range, sizes bounded before allocation, every run-config value checked before
Flower starts, Hydra typos named with the closest keys. None of these starts Flower."""

from __future__ import annotations

import typing

import pytest

from fedfuse.cli.main import main
from fedfuse.fusion import FUSION_METHODS, KFLinear, make_fusion_method
from fedfuse.fusion.options import _option_types
from fedfuse.settings.run import RunSettings
from fedfuse.settings.run_config import RANGES


@pytest.fixture(autouse=True)
def _no_flower(monkeypatch):
    """Any attempt to start Flower fails the test: the checks must fire before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("Flower was started")

    monkeypatch.setattr("fedfuse.cli.simulate.flower_environment", refuse)
    monkeypatch.setattr("fedfuse.experiments.scale.run_size", refuse)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``fedfuse argv`` run in-process (argparse's exit included)."""
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 2, err
    return code, err


# ------------------------------------------------------------------ 1. fusion options in range
def test_a_huge_count_option_fails_in_fuse_naming_method_option_and_range(capsys):
    code, err = run_cli(capsys, "fuse", "a.st", "b.st", "--option", "n_init=1000000000000")
    assert code != 0
    assert "'kf-linear'" in err and "n_init=1000000000000" in err and "1 to 1000" in err


@pytest.mark.parametrize(
    ("method", "option", "value"),
    [
        ("kf-linear", "max_iter", 0),
        ("kf-sites", "n_init", 10**9),
        ("fedma", "iterations", 10**9),
        ("fedma", "width_factor", 1e9),
        ("kd", "epochs", 10**9),
        ("fs-merge", "eval_points", 0),
        ("hf-gradient", "batch_size", 0),
        ("otfusion", "max_iter", 10**12),
        ("fedavg", "batch_size", -1),
    ],
)
def test_every_path_that_builds_a_method_checks_its_ranges(method, option, value):
    cls = FUSION_METHODS[method]
    for build in (
        lambda: make_fusion_method(method, **{option: value}),
        lambda: cls(**{option: value}),
        lambda: cls.config_class()(**{option: value}),
    ):
        with pytest.raises(ValueError, match=rf"'{method}': option {option}=.* out of range"):
            build()


def test_every_count_option_of_every_method_has_a_range():
    unbounded = []
    for name, cls in FUSION_METHODS.items():
        for option, hint in _option_types(cls).items():
            kinds = set(typing.get_args(hint)) or {hint}
            if int in kinds and cls.option_range(option) is None:
                unbounded.append(f"{name}.{option}")
    assert unbounded == []


def test_values_in_range_still_build():
    assert KFLinear(n_init=4, max_iter=300).n_init == 4
    assert make_fusion_method("fs-merge", rank=-1, epochs=0).rank == -1


# ------------------------------------------------------------------ 2. sizes before allocation
def test_huge_target_widths_fail_before_anything_is_loaded(capsys):
    code, err = run_cli(capsys, "fuse", "a.st", "b.st", "--target-widths", "1000000,1000000")
    assert code != 0 and "--target-widths" in err and "65536" in err


def test_the_fused_parameter_count_is_bounded_and_the_limit_named():
    from fedfuse.models import make_spec

    spec = make_spec("mlp", (1, 28, 28), 10, widths=(512, 512, 512))
    settings = RunSettings(fused_widths="60000,60000,60000")
    with pytest.raises(ValueError, match=r"parameters, over the limit of 2e\+08.*max-parameters"):
        settings.fused_spec(spec)
    assert settings.fused_spec(spec, max_parameters=10**10).widths == (60000,) * 3


def test_simulate_checks_fused_widths_before_flower(capsys):
    code, err = run_cli(
        capsys, "simulate", "--run-config", 'fused-widths="1000000,1000000,1000000"'
    )
    assert code != 0 and "fused-widths" in err and "65536" in err


def test_simulate_checks_the_split_before_flower(capsys, monkeypatch):
    # a sharded split gives each site its own classes: 12 sites of 10 classes cannot be made
    monkeypatch.setattr(
        "fedfuse.cli.simulate.flower_environment",
        lambda: pytest.fail("Flower must not start"),
    )
    code, err = run_cli(capsys, "simulate", "--num-clients", "12")
    assert code != 0 and "sharded split needs num_clients <= num_classes, got 12 > 10" in err


# ------------------------------------------------------------------ 3. run config before Flower
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--timeout", "-5"], "--timeout"),
        (["--grace", "-1"], "--grace"),
        (["--num-clients", "1"], "--num-clients"),
        (["--cpus-per-client", "0"], "--cpus-per-client"),
        (["--run-config", "local-epochs=-1"], "local-epochs=-1"),
        (["--run-config", "lr=0.0"], "lr=0.0"),
        (["--run-config", "batch-size=0"], "batch-size=0"),
        (["--run-config", 'init="nope"'], "independent, shared"),
        (["--run-config", 'strategy="kf-linaer"'], "kf-linaer"),
        (["--run-config", 'strategy="fedavg,kf-linear,fedavg"'], "listed more than once: fedavg"),
        (["--run-config", "bogus=1"], "'bogus'"),
        (["--run-config", "local-epoch=2"], "closest: 'local-epochs'"),
    ],
)
def test_simulate_rejects_bad_values_in_one_line_before_flower(capsys, argv, named):
    code, err = run_cli(capsys, "simulate", *argv)
    assert code != 0 and named in err


def test_every_numeric_run_setting_has_a_range():
    import dataclasses

    numeric = [
        f.name
        for f in dataclasses.fields(RunSettings)
        if isinstance(f.default, int | float) and not isinstance(f.default, bool)
    ]
    assert sorted(set(numeric) - set(RANGES)) == []


def test_run_config_types_are_strict():
    with pytest.raises(ValueError, match="local-epochs=2.5 must be an integer"):
        RunSettings.from_config({"local-epochs": 2.5})
    assert RunSettings.from_config({"local-epochs": 2.0, "lr": 1}).local_epochs == 2


def test_scale_checks_its_run_config_before_the_first_run(capsys, tmp_path):
    out = str(tmp_path / "scale")
    code, err = run_cli(
        capsys, "scale", "--sites", "2", "--run-config", "bogus=1", "--output-dir", out
    )
    assert code != 0 and "'bogus'" in err
    code, err = run_cli(capsys, "scale", "--timeout", "0", "--output-dir", out)
    assert code != 0 and "--timeout" in err


# ------------------------------------------------------------------ 4. Hydra typos
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["compare", "nonexistent=1"], "unknown config key 'nonexistent'"),
        (["compare", "+bogus_key=1"], "unknown config key 'bogus_key'"),
        (["compare", "trainng.epochs=3"], "closest: 'training.epochs'"),
        (["compare", "method=nosuch"], "unknown method 'nosuch'; choose from: "),
        (["compare", "-m", "method=kf-linear,nosuch"], "unknown method 'nosuch'"),
        (["compare", "method.n_initt=3"], "closest: 'n_init'"),
        (["compare", "-m", "method=kf-linear,regmean", "method.n_init=3"], "'regmean'"),
        (["compare", "training.epochs=-1"], "training.epochs"),
        (["compare", "method.n_init=0"], "n_init=0 is out of range"),
        (["compare", "a=b=("], "cannot parse override"),
        (["bench", "fmnist-sharded-2", "nonexistent=1"], "unknown config key 'nonexistent'"),
        (["bench", "nosuch"], "unknown experiment 'nosuch'"),
        (["simulate", "bogus_key=1"], "unknown config key 'bogus_key'"),
        (["simulate", "method.n_initt=3"], "closest: 'n_init'"),
    ],
)
def test_hydra_config_errors_are_one_line(capsys, argv, named):
    code, err = run_cli(capsys, *argv)
    assert code != 0
    assert err.startswith(f"fedfuse {argv[0]}: error: ") and named in err


def test_valid_hydra_configs_still_compose(capsys):
    assert main(["compare", "--cfg", "job"]) == 0
    assert "method:" in capsys.readouterr().out
    assert main(["compare", "--cfg", "job", "training.epochs=5", "method.n_init=4"]) == 0
    out = capsys.readouterr().out
    assert "epochs: 5" in out and "n_init: 4" in out


def test_a_method_option_the_yaml_does_not_list_is_added():
    from fedfuse.settings.hydra import validate_overrides

    assert validate_overrides(["method.n_init=4", "sites=2,4"]) == [
        "++method.n_init=4",
        "sites=2,4",
    ]
    assert validate_overrides(["--help", "nonsense"]) == ["--help", "nonsense"]
