"""Hydra configs (composition, unknown keys, the run-config round trip) and ``fedfuse compare``:
cache keys, the library runner with resume, and the Flower runner giving the same rows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from fedfuse.experiments import compare, compare_library, row_ids
from fedfuse.federation.site_cache import site_set_fields, site_set_key
from fedfuse.fusion import FUSION_METHODS, make_fusion_method
from fedfuse.settings.hydra import (
    available_options,
    compose,
    config_dir,
    method_from_config,
    overrides_from_settings,
    settings_from_config,
)
from fedfuse.settings.run import RunSettings

#: a tiny real setting: sklearn digits (bundled with scikit-learn), a small MLP, short training
TINY = [
    "dataset=digits",
    "model.widths=[32,32]",
    "training.epochs=4",
    "training.lr=0.01",
    "scores.samples=64",
]


# ------------------------------------------------------------------------------ composition
def test_default_config_is_the_flower_apps_default():
    settings = settings_from_config(compose())
    defaults = RunSettings()
    differing = {
        f.name
        for f in dataclasses.fields(RunSettings)
        if f.name != "extra" and getattr(settings, f.name) != getattr(defaults, f.name)
    }
    # the Flower app runs two methods at once; a Hydra job holds one
    assert differing == {"methods"}, differing
    assert settings.methods == "kf-linear"


@pytest.mark.parametrize("experiment", available_options("experiment"))
@pytest.mark.parametrize("method", ["kf-linear", "regmean", "kf-gradient-setting2"])
def test_run_config_and_hydra_config_compose_into_each_other(experiment, method):
    settings = settings_from_config(compose([f"experiment={experiment}", f"method={method}"]))
    overrides = overrides_from_settings(settings, sites=settings.min_nodes)
    assert settings_from_config(compose(overrides)) == settings
    assert RunSettings.from_config(settings.to_config()) == settings


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (["partition.alpha=1"], ConfigCompositionException, "partition.alpha"),
        (["method.ridgee=1"], ConfigCompositionException, "method.ridgee"),
        (["+training.epochz=3"], ValueError, r"unknown config key\(s\) \['training.epochz'\]"),
        (["+runner.workers=3"], ValueError, "runner.workers"),
        (["method.ridge=abc"], ValueError, "option ridge='abc' must be float or None"),
        (["partition=nope"], ConfigCompositionException, "nope"),
        (["partition.class_groups=[[0,1],[1,2]]"], ValueError, "class 1 is in groups"),
    ],
)
def test_unknown_keys_and_bad_values_are_errors_naming_them(overrides, error, match):
    with pytest.raises(error, match=match):
        settings_from_config(compose(overrides))


def test_unknown_run_config_keys_are_errors_too():
    with pytest.raises(ValueError, match=r"unknown run config key 'epochz'"):
        RunSettings.from_config({"epochz": 3})


def _plain(value):
    """YAML has lists where constructors default to tuples."""
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("option", available_options("method"))
def test_every_method_config_is_exactly_its_constructor(option):
    text = (config_dir() / "method" / f"{option}.yaml").read_text()
    raw = yaml.safe_load(text)
    method = method_from_config(compose([f"method={option}"]).method)
    if "defaults" not in raw:  # a base config: keys are exactly the options, values the defaults
        keys = set(raw) - {"_target_"}
        assert keys == set(type(method).accepted_options())
        expected = {k: v for k, v in raw.items() if k not in ("_target_", "device")}
        assert {k: method.options()[k] for k in expected} == expected
        # the YAML restates the constructor's defaults (struct mode needs the keys): pin them
        defaults = type(method).option_defaults()
        assert {k: _plain(v) for k, v in expected.items()} == {
            k: _plain(defaults[k]) for k in expected
        }
    assert method.name in FUSION_METHODS


def test_every_registered_method_has_a_config():
    assert set(FUSION_METHODS) <= set(available_options("method"))


def test_bloodmnist_hospitals_preset_splits_white_cells_from_the_rest():
    settings = settings_from_config(compose(["experiment=bloodmnist-hospitals"]))
    assert settings.dataset == "bloodmnist" and settings.partitioner == "sharded"
    assert settings.class_groups() == [[0, 1, 3, 4, 5, 6], [2, 7]]


def test_simulate_takes_hydra_overrides_and_refuses_a_key_set_twice():
    from fedfuse.cli.simulate import _run_config_from_overrides

    run_config, sites = _run_config_from_overrides(
        ["partition=dirichlet", "sites=4", "method=regmean"], "reply-timeout=60"
    )
    assert sites == 4
    assert 'partitioner="dirichlet"' in run_config and 'strategy="regmean"' in run_config
    assert "reply-timeout=60" in run_config
    with pytest.raises(ValueError, match=r"\['seed'\] are set by the Hydra overrides too"):
        _run_config_from_overrides(["seed=1"], "seed=2")


# ------------------------------------------------------------------------------- cache keys
def test_site_set_key_covers_training_and_nothing_else():
    base = RunSettings()
    key = site_set_key(base, 2)
    for change in (
        {"seed": 1},
        {"local_epochs": 2},
        {"partitioner": "dirichlet"},
        {"mlp_widths": "64"},
        {"lr": 0.01},
        {"score_samples": 128},
        {"sharded_class_groups": "0,1,2,3,4;5,6,7,8,9"},
        {"validation_share": 0.2},
    ):
        assert site_set_key(dataclasses.replace(base, **change), 2) != key, change
    # without held-out rows the key is the one sites had before the field existed
    assert "validation_share" not in site_set_fields(base, 2)
    assert site_set_key(base, 3) != key
    for same in (
        {"methods": "regmean"},
        {"score_method": "deeplift"},
        {"fusion_samples": 100},
        {"test_samples": 10},
        {"dirichlet_alpha_min": 3.0},  # not a parameter of the sharded split
        {"output_dir": "elsewhere"},
    ):
        assert site_set_key(dataclasses.replace(base, **same), 2) == key, same


def test_row_id_covers_result_options_only():
    settings = RunSettings()
    kf = make_fusion_method("kf-linear")
    row = row_ids.row_id(settings, 2, kf, "library")
    assert (
        row_ids.row_id(settings, 2, make_fusion_method("kf-linear", progress=True), "library")
        == row
    )
    assert row_ids.row_id(settings, 2, make_fusion_method("kf-linear", ridge=0.1), "library") != row
    assert row_ids.row_id(settings, 2, kf, "flower") != row
    assert (
        row_ids.row_id(dataclasses.replace(settings, score_method="uniform"), 2, kf, "library")
        != row
    )
    assert row_ids.row_id(settings, 4, kf, "library") != row


# ---------------------------------------------------------------------------------- runners
def _rows(sweep: Path) -> dict[tuple, dict]:
    rows = [json.loads(p.read_text()) for p in sorted((sweep / "rows").glob("*.json"))]
    return {(r["method"], r["sites"], r["seed"], r["runner"]): r for r in rows}


def test_library_sweep_trains_each_site_set_once_and_resumes(tmp_path, monkeypatch):
    import fedfuse.federation.site as site

    trained: list[tuple[int, int]] = []
    real_train = site._train

    def counting_train(settings, data, seed, *args):
        trained.append((settings.min_nodes, seed))
        return real_train(settings, data, seed, *args)

    monkeypatch.setattr(site, "_train", counting_train)
    argv = [
        "-m",
        *TINY,
        "sites=2,3",
        "method=regmean,kf-linear,fedavg,hf-linear",
        f"output_dir={tmp_path}",
    ]
    assert compare.main(argv) == 0
    rows = _rows(tmp_path / "default")
    assert len(rows) == 8 and len(trained) == 5  # 2 + 3 sites, each trained once
    assert rows[("hf-linear", 3, 0, "library")]["status"] == "ok"  # N models, matched
    ok = rows[("kf-linear", 2, 0, "library")]
    assert ok["status"] == "ok" and 0 <= ok["accuracy"] <= 1
    assert len(ok["base_accuracies"]) == 2 and ok["upload_bytes_per_site"][0] > 0
    assert (tmp_path / "default" / ok["fused_checkpoint"]).is_file()
    # only a method that reads Gram matrices pays for uploading them
    regmean, fedavg = rows[("regmean", 2, 0, "library")], rows[("fedavg", 2, 0, "library")]
    assert fedavg["upload_bytes_per_site"] == ok["upload_bytes_per_site"]
    assert regmean["upload_bytes_per_site"][0] > fedavg["upload_bytes_per_site"][0]

    # an interrupted sweep: a site set half-trained, a row missing; the rerun finishes both
    monkeypatch.setattr(
        site,
        "_train",
        lambda s, d, seed, *a: (
            (_ for _ in ()).throw(KeyboardInterrupt)
            if seed % 1000 == 2
            else counting_train(s, d, seed, *a)
        ),
    )
    with pytest.raises(KeyboardInterrupt):
        compare.main(["-m", *TINY, "sites=2", "method=fedavg", "seed=1", f"output_dir={tmp_path}"])
    monkeypatch.setattr(site, "_train", counting_train)
    before = len(trained)
    assert compare.main(argv[:-1] + ["seed=0,1", f"output_dir={tmp_path}"]) == 0
    # seed 0 all done; seed 1: site 0 survived the interruption, only site 1 and the
    # 3-site set are trained
    assert len(trained) - before == 1 + 3
    assert len(_rows(tmp_path / "default")) == 16


@pytest.mark.e2e
def test_flower_runner_gives_the_library_runners_rows(tmp_path):
    """Zero-shot and fine-tuned on the sites (the Flower round against its in-process twin)."""
    common = [*TINY, "sites=2", "method=kf-linear", "seed=0", "partition=dirichlet"]
    common += ["finetune=sites", "finetune.epochs=1"]
    assert compare.main([*common, f"output_dir={tmp_path / 'lib'}"]) == 0
    assert compare.main([*common, "runner=flower", f"output_dir={tmp_path / 'flwr'}"]) == 0
    library = {r["stage"]: r for r in _rows_list(tmp_path / "lib" / "default")}
    flower = {r["stage"]: r for r in _rows_list(tmp_path / "flwr" / "default")}
    assert sorted(flower) == sorted(library) == ["finetuned", "zero-shot"]
    for stage in ("zero-shot", "finetuned"):
        assert flower[stage]["status"] == "ok", flower[stage]["error"]
        assert flower[stage]["runner"] == "flower" and library[stage]["runner"] == "library"
        assert flower[stage]["label"] == library[stage]["label"]
        for key in (
            "accuracy",
            "loss",
            "base_accuracies",
            "ensemble_accuracy",
            "upload_bytes_per_site",
        ):
            assert flower[stage][key] == pytest.approx(library[stage][key], abs=1e-6), key
        assert flower[stage]["round_upload_bytes"] == library[stage]["round_upload_bytes"]
    assert len(flower["finetuned"]["round_upload_bytes"]) == 1  # the sites' fine-tuned models


def test_composed_config_records_in_the_row(tmp_path):
    assert compare.main([*TINY, "method=fedavg", f"output_dir={tmp_path}", "name=tiny"]) == 0
    (row,) = _rows(tmp_path / "default").values()
    assert row["experiment"] == "tiny" and row["dataset"] == "digits"
    settings = RunSettings.from_config(row["settings"])
    assert settings.mlp_widths == "32,32" and settings.local_epochs == 4
    assert OmegaConf.create(row["options"]) is not None


# ------------------------------------------------------------- fine-tuning and augmentation
@pytest.mark.parametrize(
    "overrides",
    [
        ["finetune=sites", "finetune.lr=0.001", "finetune.restart_epochs=2"],
        ["finetune=fusion-set", "fusion_set.augment_copies=3", "fusion_set.augment_flip=false"],
        ["fusion_set=balanced", "fusion_set.augment_copies=1", "fusion_set.augment_padding=2"],
    ],
)
def test_finetune_and_augmentation_keys_round_trip(overrides):
    settings = settings_from_config(compose(overrides))
    assert settings.finetune_epochs > 0 or settings.fusion_augment_copies > 0
    assert settings_from_config(compose(overrides_from_settings(settings))) == settings
    assert RunSettings.from_config(settings.to_config()) == settings
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['finetune.epochz'\]"):
        settings_from_config(compose([*overrides, "+finetune.epochz=3"]))


def test_row_ids_of_augmented_and_fine_tuned_rows():
    settings, kf = RunSettings(), make_fusion_method("kf-linear")
    plain = row_ids.row_id(settings, 2, kf, "library")
    tuned = dataclasses.replace(settings, finetune_epochs=5)
    assert row_ids.row_id(tuned, 2, kf, "library") == plain  # the zero-shot row is shared
    ft = row_ids.row_id(tuned, 2, kf, "library", "finetuned")
    assert ft.startswith("kf-linear-ft-") and ft != plain
    on_sites = dataclasses.replace(tuned, finetune_data="sites")
    assert row_ids.row_id(on_sites, 2, kf, "library", "finetuned") != ft
    augmented = dataclasses.replace(settings, fusion_augment_copies=2)
    assert row_ids.row_id(augmented, 2, kf, "library") != plain


def test_a_fine_tuning_job_writes_a_zero_shot_and_a_fine_tuned_row(tmp_path, monkeypatch):
    from fedfuse.experiments.report.rows import load_sweep, summarize

    common = [*TINY, "method=kf-linear", f"output_dir={tmp_path}"]
    assert compare.main([*common, "finetune=fusion-set", "finetune.epochs=2"]) == 0
    rows = [json.loads(p.read_text()) for p in sorted((tmp_path / "default/rows").glob("*.json"))]
    by_stage = {r["stage"]: r for r in rows}
    assert sorted(by_stage) == ["finetuned", "zero-shot"] and len(rows) == 2
    zero, tuned = by_stage["zero-shot"], by_stage["finetuned"]
    assert zero["label"] == "kf-linear" and tuned["label"] == "kf-linear +ft(fusion-set,2ep)"
    assert zero["status"] == tuned["status"] == "ok"
    assert tuned["zero_shot_row_id"] == zero["row_id"] and tuned["row_id"] != zero["row_id"]
    assert tuned["finetune"]["epochs"] == 2 and "finetune" not in zero
    assert zero["settings"]["finetune-epochs"] == 0  # the zero-shot row is the same for all
    assert tuned["finetune_details"]["loss_after"] < tuned["finetune_details"]["loss_before"]
    assert tuned["base_accuracies"] == zero["base_accuracies"] and tuned["finetune_seconds"] > 0
    assert (tmp_path / "default" / tuned["fused_checkpoint"]).is_file()

    # on the sites, a finished zero-shot row is reused: no fusion, one more round of uploads
    def no_fusion(*args):
        raise AssertionError("the zero-shot row was done; nothing should fuse again")

    monkeypatch.setattr(compare_library, "_fuse_library", no_fusion)
    assert compare.main([*common, "finetune=sites", "finetune.epochs=1"]) == 0
    rows = [json.loads(p.read_text()) for p in sorted((tmp_path / "default/rows").glob("*.json"))]
    sites = next(r for r in rows if r["label"] == "kf-linear +ft(sites,1ep)")
    assert sites["status"] == "ok", sites["error"]
    assert len(sites["round_upload_bytes"]) == 1 and len(sites["round_upload_bytes"][0]) == 2
    assert len(sites["finetune_details"]["sites"]) == 2

    # the report keeps the three rows apart, zero-shot first
    summary = [r for r in summarize(load_sweep(tmp_path / "default").rows) if not r.reference]
    assert [(r.label, r.stage) for r in summary] == [
        ("kf-linear", "zero-shot"),
        ("kf-linear +ft(fusion-set,2ep)", "finetuned"),
        ("kf-linear +ft(sites,1ep)", "finetuned"),
    ]


def test_an_augmented_fusion_set_is_a_row_of_its_own(tmp_path):
    common = [*TINY, "method=kf-linear", f"output_dir={tmp_path}"]
    assert compare.main(common) == 0
    assert (
        compare.main([*common, "fusion_set.augment_copies=2", "fusion_set.augment_padding=1"]) == 0
    )
    rows = {r["label"]: r for r in _rows_list(tmp_path / "default")}
    assert sorted(rows) == ["kf-linear", "kf-linear +aug(x2,pad=1)"]
    augmented = rows["kf-linear +aug(x2,pad=1)"]
    assert augmented["stage"] == "zero-shot" and augmented["status"] == "ok"
    assert augmented["fusion_augment"] == {"copies": 2, "flip": True, "padding": 1}
    assert rows["kf-linear"]["fusion_augment"] is None


def test_a_wider_fused_model_is_a_row_of_its_own_with_its_size(tmp_path):
    common = [*TINY, "method=kf-linear", f"output_dir={tmp_path}"]
    assert compare.main(common) == 0
    assert compare.main([*common, "fused_widths=2x"]) == 0
    rows = {r["label"]: r for r in _rows_list(tmp_path / "default")}
    assert sorted(rows) == ["kf-linear", "kf-linear widths(2x)"]
    same, wide = rows["kf-linear"], rows["kf-linear widths(2x)"]
    assert wide["status"] == "ok", wide.get("error")
    assert same["fused_parameters"] == same["site_parameters"]
    assert wide["site_parameters"] == same["site_parameters"]
    assert wide["fused_parameters"] > 1.5 * wide["site_parameters"]


def _rows_list(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((sweep / "rows").glob("*.json"))]


def test_an_inverted_fusion_set_is_a_row_of_its_own_and_needs_batchnorm(tmp_path):
    resnet = [
        "dataset=digits",
        "model=resnet",
        "model.options.width_multiplier=0.0625",
        "training.epochs=1",
        "scores.samples=32",
        "method=kf-linear",
        f"output_dir={tmp_path}",
    ]
    inverted = ["fusion_set.invert_samples=6", "fusion_set.invert_steps=3"]
    assert compare.main([*resnet, *inverted]) == 0
    (row,) = _rows_list(tmp_path / "default")
    assert row["status"] == "ok", row.get("error")
    assert row["label"] == "kf-linear +inv(x6,steps=3)"
    assert row["inverted_fusion_set_seconds"] > 0
    # a model without BatchNorm is refused before any site trains, by the key's name
    mlp = [*TINY, "method=kf-linear", f"output_dir={tmp_path / 'mlp'}", *inverted]
    assert compare.main(mlp) == 0  # a failed job is a row; the sweep goes on
    (failed,) = _rows_list(tmp_path / "mlp" / "default")
    assert failed["status"] == "failed"
    assert "fusion_set.invert_samples" in failed["error"] and "BatchNorm" in failed["error"]
    assert not list((tmp_path / "mlp").rglob("site_*.safetensors"))


def test_class_gaussians_complete_the_fusion_set_in_a_row_of_their_own(tmp_path):
    gaussians = ["fusion_set.gaussian_samples=30", "fusion_set.gaussian_rank=4"]
    common = [*TINY, "sites=2", "partition=sharded", "method=kf-trust"]
    assert compare.main([*common, f"output_dir={tmp_path}", *gaussians]) == 0
    (row,) = _rows_list(tmp_path / "default")
    assert row["status"] == "ok", row.get("error")
    assert row["label"] == "kf-trust +gauss(x30,rank=4)"
    # per class (10 of digits): a count, a noise variance, a mean and 4 loadings of 64 pixels
    assert row["gaussian_upload_bytes"] == 10 * 8 + 10 * 4 + 10 * 64 * 4 + 10 * 64 * 4 * 4
    assert row["gaussian_fusion_set_seconds"] >= 0
    # a method that reads no fusion set gets none of it: the sites send nothing more
    fedavg = [*TINY, "sites=2", "partition=sharded", "method=fedavg", *gaussians]
    assert compare.main([*fedavg, f"output_dir={tmp_path / 'fedavg'}"]) == 0
    (plain,) = _rows_list(tmp_path / "fedavg" / "default")
    assert plain["status"] == "ok" and plain["gaussian_upload_bytes"] is None


def test_kf_trust_fuses_real_sites_on_a_balanced_fusion_set(tmp_path):
    common = [*TINY, "sites=2", "partition=sharded", "method=kf-trust,kf-linear"]
    assert compare.main(["-m", *common, "fusion_set=balanced", f"output_dir={tmp_path}"]) == 0
    rows = {r["method"]: r for r in _rows_list(tmp_path / "default")}
    assert rows["kf-trust"]["status"] == "ok", rows["kf-trust"].get("error")
    trust = rows["kf-trust"]
    # digits, two sites of 5 classes each: far above one site's model (about half)
    assert trust["accuracy"] > 0.6 > max(trust["base_accuracies"])
    assert trust["round_upload_bytes"] == []  # one upload, the fits on the server
    # each of the 400 fusion rows shared between the models by their belief in its label
    rows_per_model = trust["details"]["trust"]["rows_per_model"]
    assert sum(rows_per_model) == pytest.approx(trust["settings"]["fusion-samples"], abs=0.1)
