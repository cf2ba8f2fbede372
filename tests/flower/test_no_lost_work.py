"""No lost work: methods are checked before training, a failing method costs only itself, every
upload is on disk before fusion, and a saved run can be fused again; the partition cache."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedfuse.cli.main import main
from fedfuse.clients.records import pack_upload
from fedfuse.data.partition_cache import PartitionCache
from fedfuse.federation.evaluation import evaluate_fusion
from fedfuse.federation.scenario import Scenario
from fedfuse.federation.site import SiteIdentity, train_site
from fedfuse.federation.uploads import UploadStore
from fedfuse.fusion import FUSION_METHODS, FusionMethod, make_fusion_method
from fedfuse.io.atomic import write_json
from fedfuse.models import Ensemble, mlp_spec, resnet_spec, vgg11_spec
from fedfuse.settings.run import RunSettings
from fedfuse.strategies.one_shot import OneShotFusion
from fedfuse.strategies.preflight import FusionAborted, MethodsUnfit, check_methods
from fedfuse.training.loop import evaluate
from tests.fakes import NodesGrid, reply_from
from tests.helpers import patience, quick_site_settings, run_upload_request

SETTINGS = quick_site_settings(methods="kf-linear,fedavg,regmean")


pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture(scope="module")
def uploads(tmp_path_factory, monkeypatch_module):
    request = run_upload_request(SETTINGS)
    return [train_site(SETTINGS, SiteIdentity(pid, 3), request) for pid in range(3)]


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("FEDFUSE_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield patch
    patch.undo()


# ---------------------------------------------------------------------------- before training
def test_every_method_states_what_it_can_fuse_before_training():
    mlp = mlp_spec((1, 28, 28), 10, (32, 32))
    vgg = vgg11_spec((1, 28, 28), 10, width_multiplier=0.125)
    for name, cls in FUSION_METHODS.items():
        method = make_fusion_method(name)
        for spec in (mlp, vgg):
            method.check_run(2, spec)  # every method fuses 2 MLPs or 2 VGGs
        if cls.max_models == 2:
            with pytest.raises(ValueError, match=f"{name} fuses at most 2 models, got 10"):
                method.check_run(10, mlp)
        else:
            method.check_run(100, mlp)
        if "data" in cls.requires:
            with pytest.raises(ValueError, match="a fusion set on the server"):
                method.check_run(2, mlp, available={"scores", "sample_counts"})
    # no method refuses a run only for its number of sites (issue 25: HF and Git Re-Basin fuse N)
    assert {n for n, c in FUSION_METHODS.items() if c.max_models is not None} == set()


def test_the_default_strategy_fuses_any_number_of_sites():
    methods = RunSettings().fusion_methods()
    for sites in (2, 3, 10, 100, 1000):
        check_methods(methods, sites, mlp_spec((1, 28, 28), 10, (512, 512, 512)))
    resnet = resnet_spec((3, 32, 32), 10)
    with pytest.raises(MethodsUnfit, match="1 of the listed fusion methods.*fs-merge: cannot"):
        check_methods(RunSettings(methods="kf-linear,fs-merge").fusion_methods(), 3, resnet)


def test_the_run_device_reaches_every_method_that_takes_one():
    methods = RunSettings(methods="kf-linear,otfusion,fedavg", device="cpu").fusion_methods()
    assert methods[0].options()["device"] == "cpu" and methods[1].options()["device"] == "cpu"
    explicit = RunSettings(
        methods="kf-linear", device="cpu", fusion_options="kf-linear.device=auto"
    )
    assert explicit.fusion_methods()[0].options()["device"] == "auto"
    with pytest.raises(ValueError, match="device 'gpu0' is not a device"):
        RunSettings(device="gpu0")


def test_simulate_refuses_an_unfit_method_before_flower_starts(capsys, tmp_path):
    started = time.monotonic()
    argv = ["simulate", "--num-clients", "3", "--output-dir", str(tmp_path)]
    assert main([*argv, "--run-config", "strategy='kf-linear,fs-merge' model='resnet'"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fs-merge: cannot fuse resnet models" in err
    assert main([*argv, "--run-config", "no-such-key=1"]) == 2
    assert "unknown run config key 'no-such-key'" in capsys.readouterr().err
    assert time.monotonic() - started < 20  # no SuperLink, no Ray
    assert not any(tmp_path.iterdir())


def test_a_fusion_set_that_cannot_be_built_fails_before_the_train_message(tmp_path):
    settings = RunSettings(dataset="digits", train_samples=30, fusion_samples=100)
    with pytest.raises(ValueError, match="the clients hold only 60.*lower fusion-samples"):
        Scenario(settings, 2).fusion_set()

    sent = []

    def before_training(num_sites):
        sent.append(num_sites)
        Scenario(settings, num_sites).fusion_set()

    strategy = OneShotFusion(
        [make_fusion_method("kf-linear")],
        store=UploadStore(tmp_path),
        before_training=before_training,
        node_wait_timeout=0.1,
    )
    with pytest.raises(ValueError, match="fusion set"):
        strategy.configure_train(1, ArrayRecord(), ConfigRecord(), NodesGrid([1, 2, 3]))
    assert sent == [3]


# ---------------------------------------------------------------------------- while fusing
class Exploding(FusionMethod):
    """A method whose fusion always fails (not registered: tests only)."""

    name = "exploding"

    def _fuse(self, models, inputs, target):
        raise RuntimeError("out of memory while fusing")


def test_a_failing_method_is_recorded_and_the_others_still_fuse(uploads, tmp_path):
    methods = [Exploding(), make_fusion_method("fedavg"), make_fusion_method("regmean")]
    strategy = OneShotFusion(methods, store=UploadStore(tmp_path))
    strategy._sent = [10, 11, 12]
    arrays, metrics = strategy.aggregate_train(
        1, [reply_from(pack_upload(u), 10 + u.partition_id) for u in uploads]
    )
    assert set(strategy.results) == {"fedavg", "regmean"}
    assert strategy.failures["exploding"].error == "RuntimeError: out of memory while fusing"
    # the round's arrays are the first method that succeeded
    fedavg = strategy.results["fedavg"].model.state_dict()
    assert torch.equal(arrays.to_torch_state_dict()["levels.2.bias"], fedavg["levels.2.bias"])
    assert metrics["num-uploads"] == 3

    only_failing = OneShotFusion([Exploding()], store=UploadStore(tmp_path / "other"))
    only_failing._sent = [10, 11]
    with pytest.raises(FusionAborted, match="every fusion method failed: exploding"):
        only_failing.aggregate_train(1, [reply_from(pack_upload(u), 10) for u in uploads[:2]])
    # the uploads were written before fusion, so nothing the sites did is lost
    assert len(UploadStore.open(tmp_path / "other")) == 2


# ---------------------------------------------------------------------------- after the run
def test_a_saved_run_is_fused_again_with_another_method(uploads, tmp_path, capsys):
    run = tmp_path / "run"
    store = UploadStore(run / "clients")
    for upload in uploads:
        store.add(upload, source=f"client {upload.partition_id}")
    write_json(run / "results.json", {"status": "ok", "settings": SETTINGS.to_config()})
    out = tmp_path / "otfusion.safetensors"
    argv = ["fuse", str(run), "--method", "otfusion", "--output", str(out)]
    assert main([*argv, "--test-data", "digits:test"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "fused 3 models with otfusion" in printed and "fused: otfusion" in printed
    assert out.is_file()
    assert main(["fuse", str(run), "--method", "regmean", "--output", str(tmp_path / "r")]) == 0
    assert main(["fuse", str(run), "--method", "hf-linear", "--output", str(tmp_path / "h")]) == 0
    assert "fused 3 models with hf-linear" in capsys.readouterr().out  # N models, matched
    assert main(["fuse", str(tmp_path / "missing-run")]) == 2


def test_streaming_evaluation_matches_the_ensemble_module(uploads):
    test = Scenario(SETTINGS, 3).test_set
    models = [u.model for u in uploads]
    fused = {"fedavg": models[0]}
    report = evaluate_fusion(models, fused, test, device="cpu")
    reference = evaluate(Ensemble(models), test, device="cpu")
    assert report["ensemble"]["accuracy"] == pytest.approx(reference.accuracy, abs=1e-9)
    assert report["ensemble"]["loss"] == pytest.approx(reference.loss, rel=1e-5)
    for row, model in zip(report["base"], models, strict=True):
        assert row["accuracy"] == pytest.approx(evaluate(model, test, device="cpu").accuracy)


# ---------------------------------------------------------------------------- partition cache
def _build_counter(counter_path, scenario):
    def build():
        with open(counter_path, "a") as handle:
            handle.write("built\n")
        time.sleep(0.5)  # hold the lock long enough for the other process to wait on it
        return scenario.train_set, scenario.partitions

    return build


def _open_in_process(root, counter_path, queue):
    settings = RunSettings(dataset="digits", partitioner="dirichlet", seed=3)
    scenario = Scenario(settings, 7)
    from pathlib import Path

    cache = PartitionCache.open_or_build(
        scenario.cache_fields(), _build_counter(counter_path, scenario), root=Path(root)
    )
    queue.put(cache.client_data(4).labels.tolist())


def test_partition_cache_is_built_once_and_matches_the_split(tmp_path):
    settings = RunSettings(dataset="digits", partitioner="dirichlet", seed=3)
    scenario = Scenario(settings, 7)
    counter = tmp_path / "builds.txt"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [
        context.Process(target=_open_in_process, args=(tmp_path / "cache", counter, queue))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=patience(120)) for _ in workers]
    for worker in workers:
        worker.join(timeout=patience(60))
    assert counter.read_text() == "built\n"  # two processes, one build
    expected = scenario.client_data(4, cached=False)
    assert results[0] == results[1] == expected.labels.tolist()

    cache = PartitionCache.open_or_build(
        scenario.cache_fields(), _build_counter(counter, scenario), root=tmp_path / "cache"
    )
    assert counter.read_text() == "built\n"  # reopened, not rebuilt
    for client in range(7):
        data = cache.client_data(client)
        reference = scenario.client_data(client, cached=False)
        assert torch.equal(data.images, reference.images)
        assert data.mean == reference.mean and data.num_classes == reference.num_classes
    assert all(
        np.array_equal(a, b) for a, b in zip(cache.partitions(), scenario.partitions, strict=True)
    )
    other = Scenario(RunSettings(dataset="digits", partitioner="dirichlet", seed=4), 7)
    assert other.cache_fields() != scenario.cache_fields()
    with pytest.raises(ValueError, match="partition-id 7 is outside 0..6"):
        cache.client_data(7)


def test_a_site_does_not_load_the_training_set_when_the_cache_exists(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDFUSE_CACHE", str(tmp_path))
    settings = RunSettings(dataset="digits", partitioner="iid")
    Scenario(settings, 4).client_data(0)  # builds the cache
    import fedfuse.federation.scenario as scenario_module

    def refuse(*args, **kwargs):
        raise AssertionError("a site loaded the whole training set")

    monkeypatch.setattr(scenario_module, "load_dataset", refuse)
    assert len(Scenario(settings, 4).client_data(3)) > 0


def _mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (Linux), or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5] if len(fields) > 5 else None
    return None


def test_models_of_a_store_stay_memory_mapped(uploads, tmp_path):
    store = UploadStore(tmp_path)
    for upload in uploads:
        store.add(upload, source=f"client {upload.partition_id}")
    model = store.models()[1]
    weight = model.levels[0][1].weight
    assert torch.equal(weight, uploads[1].model.levels[0][1].weight)
    # the parameter is the file's own pages, not a copy in the heap
    assert _mapped_file(weight.data_ptr()) == str(store.entries[1].path)


def test_simulate_sets_only_the_run_config_keys_the_app_declares(tmp_path):
    from fedfuse.cli.simulate import simulation_run_config

    full = simulation_run_config("lr=0.01", tmp_path, 10, app_keys=["min-nodes", "max-in-flight"])
    assert full["min-nodes"] == 10 and full["max-in-flight"] >= 4 and full["lr"] == 0.01
    mine = simulation_run_config("min-nodes=2 max-in-flight=3", tmp_path, 10)
    assert mine["min-nodes"] == 2 and mine["max-in-flight"] == 3  # the user's values win
    other_app = simulation_run_config("", tmp_path, 10, app_keys=["min-nodes"])
    assert "max-in-flight" not in other_app and other_app["output-dir"] == str(tmp_path)


def test_simulate_takes_the_output_dir_from_the_run_config_or_the_option(tmp_path):
    from fedfuse.cli.simulate import simulation_run_config

    given = simulation_run_config(f"output-dir='{tmp_path / 'runs'}'", None, 2)
    assert given["output-dir"] == str(tmp_path / "runs")
    assert simulation_run_config("", None, 2)["output-dir"].endswith("outputs")
    same = simulation_run_config(f"output-dir='{tmp_path}'", tmp_path, 2)
    assert same["output-dir"] == str(tmp_path)
    with pytest.raises(ValueError, match="--output-dir .* and run config output-dir=.* differ"):
        simulation_run_config(f"output-dir='{tmp_path / 'a'}'", tmp_path / "b", 2)
