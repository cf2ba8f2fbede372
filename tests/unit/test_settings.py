import tomllib
from pathlib import Path

import pytest

from fedfuse.federation.scenario import Scenario
from fedfuse.settings.run import RunSettings

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_app_run_config_and_settings_defaults_are_identical():
    app_config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    assert app_config == RunSettings().to_config()


def test_unknown_keys_and_bad_types_are_named():
    with pytest.raises(ValueError, match=r"unknown run config key 'stratgy'; closest: 'strategy'"):
        RunSettings.from_config({"stratgy": "fedavg"})
    with pytest.raises(ValueError, match="local-epochs='many' must be an integer"):
        RunSettings.from_config({"local-epochs": "many"})
    with pytest.raises(ValueError, match="init='random' is unknown; choose from: independent"):
        RunSettings.from_config({"init": "random"})
    with pytest.raises(ValueError, match="fusion-source"):
        RunSettings.from_config({"fusion-source": "client-0"})
    assert RunSettings.from_config({"bogus": 1}, allow_unknown=True).extra == {"bogus": 1}


def test_a_synthetic_fusion_set_excludes_a_fusion_file_and_fine_tuning_on_it():
    assert RunSettings.from_config({"fusion-source": "synthetic"}).synthetic_fusion_set
    with pytest.raises(ValueError, match="fusion-source='synthetic' and a fusion-data file"):
        RunSettings.from_config({"fusion-source": "synthetic", "fusion-data": "f.npz"})
    with pytest.raises(ValueError, match="finetune-data='sites'"):
        RunSettings.from_config(
            {"fusion-source": "synthetic", "finetune-epochs": 2, "finetune-data": "fusion-set"}
        )
    settings = RunSettings(dataset="digits", fusion_source="synthetic")
    with pytest.raises(ValueError, match="generated from the sites' uploaded models"):
        Scenario(settings, 2).fusion_set()


def test_scenario_splits_and_fusion_set_are_consistent():
    settings = RunSettings(dataset="digits", partitioner="sharded", fusion_samples=50, seed=3)
    scenario = Scenario(settings, 2)
    parts = scenario.partitions
    assert sum(len(p) for p in parts) == len(scenario.train_set)
    fusion = scenario.fusion_set()
    assert len(fusion) == 50
    # skewed: drawn from client 0's classes only
    client0_classes = set(scenario.client_data(0).labels.tolist())
    assert set(fusion.labels.tolist()) <= client0_classes
    assert scenario.class_counts().sum() == len(scenario.train_set)
    assert scenario.model_spec().input_shape == (1, 8, 8)
    with pytest.raises(ValueError, match="partition-id 2"):
        scenario.client_data(2)
    capped = Scenario(RunSettings(dataset="digits", train_samples=40), 2)
    assert [len(p) for p in capped.partitions] == [40, 40]
