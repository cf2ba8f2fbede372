"""The paper's optional steps: fine-tuning after fusion (on the fusion set, or on the sites in
one more round) and fusion-set augmentation; the library, the run settings and the Flower round
over a stand-in grid that answers with the real ClientApp handler."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from flwr.app import Context, Error, Message, RecordDict
from torch import nn

from fedfuse.clients.client_app import finetune_round
from fedfuse.clients.records import FINETUNE_MESSAGE, WEIGHTS_KEY
from fedfuse.data import load_dataset
from fedfuse.data.augmentation import augment_dataset, augment_fusion_set, random_crop_flip
from fedfuse.federation.scenario import Scenario
from fedfuse.federation.site import finetune_site
from fedfuse.models import build_model, mlp_spec
from fedfuse.settings.run import RunSettings
from fedfuse.strategies.finetune_round import SiteFinetuneRound
from fedfuse.training.averaging import WeightedAverage, average_models
from fedfuse.training.finetune import finetune
from fedfuse.training.loop import lr_factor, make_optimizer
from tests.helpers import digits_settings

SETTINGS = digits_settings(finetune_epochs=2, finetune_lr=3e-3)


@pytest.fixture(scope="module")
def digits():
    data = load_dataset("digits", "train").subset(range(300))
    return data.inputs(), data.labels


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- fine-tuning
def test_finetune_returns_a_new_model_with_a_lower_loss_and_leaves_the_input(digits):
    model = build_model(mlp_spec((1, 8, 8), 10, (16,)), seed=0)
    before = _state(model)
    tuned, details = finetune(model, *digits, epochs=5, lr=1e-2, batch_size=32, device="cpu")
    assert tuned is not model and _equal(_state(model), before)
    assert not _equal(_state(tuned), before) and not tuned.training
    assert details["loss_after"] < details["loss_before"]
    assert details["accuracy_after"] > details["accuracy_before"]
    assert details["steps"] == 5 * math.ceil(300 / 32) and len(details["train_losses"]) == 5
    unchanged, zero = finetune(model, *digits, epochs=0, device="cpu")
    assert _equal(_state(unchanged), before) and zero["steps"] == 0


def test_finetune_is_deterministic_by_seed_dropout_included(digits):
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3))
    model.append(nn.Linear(32, 10))
    runs = [
        _state(finetune(model, *digits, epochs=2, seed=seed, augment=True, device="cpu")[0])
        for seed in (3, 3, 4)
    ]
    assert _equal(runs[0], runs[1]) and not _equal(runs[0], runs[2])


def test_finetune_trains_batchnorm_models_in_train_mode(digits):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(256, 10),
    ).eval()
    inputs, labels = digits[0][:65], digits[1][:65]  # 2 batches of 32 and one single row
    tuned, details = finetune(model, inputs, labels, epochs=2, batch_size=32, device="cpu")
    assert details["steps"] == 4  # the single row is left out of each epoch
    assert int(tuned[1].num_batches_tracked) == 4 and int(model[1].num_batches_tracked) == 0
    assert not torch.equal(tuned[1].running_mean, model[1].running_mean)
    assert not tuned.training and not model.training


def test_bad_fine_tuning_inputs_are_named(digits):
    model = build_model(mlp_spec((1, 8, 8), 10, (16,)), seed=0)
    with pytest.raises(ValueError, match="min_lr <= lr"):
        finetune(model, *digits, epochs=1, lr=1e-4, min_lr=1e-3)
    with pytest.raises(ValueError, match="one label each"):
        finetune(model, digits[0], digits[1][:5], epochs=1)
    with pytest.raises(ValueError, match="augmented fine-tuning needs images"):
        finetune(model, digits[0].flatten(1), digits[1], epochs=1, augment=True)


@pytest.mark.parametrize("period", [7, 0])
def test_cosine_restarts_is_torchs_warm_restarts_stepped_per_batch(period):
    total, floor = 20, 1e-6 / 3e-4
    optimizer = make_optimizer("sgd", [nn.Parameter(torch.zeros(1))], 3e-4)
    reference = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        optimizer, T_0=period or total, eta_min=1e-6
    )
    for step in range(total):
        expected = optimizer.param_groups[0]["lr"]
        factor = lr_factor("cosine-restarts", step, total, floor=floor, period=period)
        assert 3e-4 * factor == pytest.approx(expected, rel=1e-9, abs=1e-12), step
        optimizer.step()
        reference.step()


# --------------------------------------------------------------------------- augmentation
def test_augment_fusion_set_appends_copies_after_the_originals():
    x = torch.rand(5, 3, 6, 6)
    y = torch.arange(5)
    out, labels = augment_fusion_set(x, y, copies=3, seed=1)
    assert out.shape == (20, 3, 6, 6) and torch.equal(labels, y.repeat(4))
    assert torch.equal(out[:5], x)
    again, _ = augment_fusion_set(x, y, copies=3, seed=1)
    other, _ = augment_fusion_set(x, y, copies=3, seed=2)
    assert torch.equal(out, again) and not torch.equal(out, other)
    same, same_labels = augment_fusion_set(x, y, copies=0, seed=1)
    assert torch.equal(same, x) and torch.equal(same_labels, y)


def test_flips_mirror_whole_images_and_can_be_turned_off():
    x, y = torch.rand(64, 1, 5, 5), torch.zeros(64, dtype=torch.long)
    flipped, _ = augment_fusion_set(x, y, copies=1, seed=0, crop_padding=0)
    pairs = list(zip(flipped[64:], x, strict=True))
    mirrored = torch.tensor([torch.equal(c, o.flip(-1)) for c, o in pairs])
    kept = torch.tensor([torch.equal(c, o) for c, o in pairs])
    assert bool((mirrored | kept).all()) and 10 < int(mirrored.sum()) < 54
    plain, _ = augment_fusion_set(x, y, copies=2, seed=0, flip=False, crop_padding=0)
    assert torch.equal(plain[64:128], x) and torch.equal(plain[128:], x)


def test_crops_are_windows_of_the_zero_padded_image():
    x = torch.randint(1, 255, (30, 2, 4, 4), dtype=torch.uint8)
    out = random_crop_flip(x, torch.Generator().manual_seed(0), padding=1, flip=False)
    assert out.dtype == torch.uint8 and out.shape == x.shape
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1))
    for image, source in zip(out, padded, strict=True):
        windows = [source[:, r : r + 4, c : c + 4] for r in range(3) for c in range(3)]
        assert any(torch.equal(image, w) for w in windows)


def test_flat_inputs_are_refused():
    with pytest.raises(ValueError, match="flat inputs cannot be cropped or flipped"):
        augment_fusion_set(torch.rand(4, 64), torch.zeros(4), copies=1, seed=0)
    with pytest.raises(ValueError, match="copies must be an integer >= 0"):
        augment_fusion_set(torch.rand(4, 1, 8, 8), torch.zeros(4), copies=-1, seed=0)


def test_the_scenarios_fusion_set_carries_its_augmented_copies():
    plain = RunSettings(dataset="digits", fusion_samples=40)
    augmented = RunSettings(
        dataset="digits", fusion_samples=40, fusion_augment_copies=2, fusion_augment_padding=1
    )
    base = Scenario(plain, 2).fusion_set()
    fusion = Scenario(augmented, 2).fusion_set()
    assert len(fusion) == 120 and torch.equal(fusion.images[:40], base.images)
    assert torch.equal(fusion.labels, base.labels.repeat(3))
    direct = augment_dataset(base, copies=2, seed=augmented.seed + 3, crop_padding=1)
    assert torch.equal(direct.images, fusion.images) and direct.num_classes == base.num_classes


# --------------------------------------------------------------------------- settings
def test_run_settings_check_and_label_the_new_keys():
    assert RunSettings().finetune_label() == "" and RunSettings().augment_label() == ""
    assert SETTINGS.finetune_label() == "+ft(fusion-set,2ep,lr=0.003)"
    sites = RunSettings(finetune_epochs=3, finetune_data="sites")
    assert sites.finetune_label() == "+ft(sites,3ep)"
    assert RunSettings(fusion_augment_copies=4).augment_label() == "+aug(x4)"
    assert (
        RunSettings(fusion_augment_copies=2, fusion_augment_flip=False).augment_label()
        == "+aug(x2,noflip)"
    )
    assert RunSettings.from_config({"fusion-augment-flip": "false"}).fusion_augment_flip is False
    with pytest.raises(ValueError, match="fusion-augment-flip='maybe' must be a boolean"):
        RunSettings.from_config({"fusion-augment-flip": "maybe"})
    with pytest.raises(ValueError, match="finetune-data='server' is unknown; choose from"):
        RunSettings(finetune_data="server")
    with pytest.raises(ValueError, match="finetune-min-lr <= finetune-lr"):
        RunSettings(finetune_lr=1e-6, finetune_min_lr=1e-3)
    kwargs = RunSettings(optimizer="sgd", batch_size=32).finetune_kwargs()
    assert kwargs["optimizer"] == "sgd" and kwargs["batch_size"] == 32  # the sites' recipe


# --------------------------------------------------------------------------- averaging
def test_weighted_average_covers_batchnorm_buffers():
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        bn = nn.BatchNorm1d(3)
        bn.running_mean.uniform_()
        bn.num_batches_tracked.fill_(seed * 10)
        models.append(bn)
    merged = average_models(models, [1, 1, 2])
    expected = (models[0].running_mean + models[1].running_mean + 2 * models[2].running_mean) / 4
    torch.testing.assert_close(merged.running_mean, expected)
    torch.testing.assert_close(
        merged.weight, (models[0].weight + models[1].weight + 2 * models[2].weight) / 4
    )
    assert int(merged.num_batches_tracked) == 12 and merged is not models[0]
    with pytest.raises(ValueError, match="positive"):
        WeightedAverage().add(models[0].state_dict(), 0.0)


# --------------------------------------------------------------------------- the Flower round
class _SitesGrid:
    """A grid whose nodes are sites of a 2-site digits split running fedfuse's ClientApp
    handler in-process; node 13 crashes, node 14 answers with poisoned weights."""

    partition_of = {11: 0, 12: 1, 13: 0, 14: 1}

    def __init__(self):
        self.outstanding: dict[str, Message] = {}

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            assert msg.metadata.message_type == FINETUNE_MESSAGE
            ids.append(f"m{msg.metadata.dst_node_id}")
            self.outstanding[ids[-1]] = msg
        return ids

    def pull_messages(self, message_ids):
        replies = []
        for mid in message_ids:
            msg = self.outstanding.pop(mid)
            node = msg.metadata.dst_node_id
            if node == 13:
                reply = Message(Error(code=0, reason="Message: site crashed"), reply_to=msg)
            else:
                config = {"partition-id": self.partition_of[node], "num-partitions": 2}
                context = Context(1, node, config, RecordDict(), SETTINGS.to_config())
                reply = finetune_round(msg, context)
                if node == 14:
                    state = reply.content.array_records[WEIGHTS_KEY].to_torch_state_dict()
                    state["levels.0.1.bias"][0] = math.nan
                    reply.content.array_records[WEIGHTS_KEY] = type(
                        reply.content.array_records[WEIGHTS_KEY]
                    )(state)
            reply.metadata.__dict__["_reply_to_message_id"] = mid
            replies.append(reply)
        return replies


def test_the_site_round_averages_the_good_sites_and_names_the_bad(task_identity):
    scenario = Scenario(SETTINGS, 2)
    fused = build_model(scenario.model_spec(), seed=5)
    before = _state(fused)
    round_ = SiteFinetuneRound(
        _SitesGrid(),
        [11, 12, 13, 14],
        ["client 0 (node 11)", "client 1 (node 12)", "client 0 (node 13)", "client 1 (node 14)"],
        [0, 1, 2, 3],
        [30.0, 10.0, 5.0, 5.0],
        timeout=30,
    )
    merged, details = round_.run(fused, "kf-linear +ft(fusion-set,2ep)")
    assert _equal(_state(fused), before) and merged is not fused
    assert details["sites"] == [0, 1] and details["weights"] == {"0": 0.75, "1": 0.25}
    assert len(round_.problems) == 2
    assert "client 0 (node 13): fine-tuning round: the client failed: site crashed" in (
        round_.problems
    )
    assert any("client 1 (node 14)" in p and "NaN" in p for p in round_.problems)
    # the same as the library's in-process round (what fedfuse compare's library runner does)
    tuned = [finetune_site(SETTINGS, copy.deepcopy(fused), pid, 2) for pid in (0, 1)]
    expected = average_models([t.model for t in tuned], [30, 10])
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], value, rtol=1e-6, atol=1e-7)


def test_a_site_run_in_the_callers_process_gives_its_threads_back():
    # a site caps torch to its share of the cores; run in-process (a test, fedfuse compare, a
    # library user) it must not leave the caller on that share: a process left on one thread
    # once ran every later test there (and met a one-thread oneDNN bug, see test_data.py)
    fused = build_model(Scenario(SETTINGS, 2).model_spec(), seed=5)
    found = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        finetune_site(digits_settings(threads=1, finetune_epochs=1), fused, 0, 2)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(found)


def test_a_round_nobody_answers_fails_naming_every_site(task_identity):
    fused = build_model(Scenario(SETTINGS, 2).model_spec(), seed=5)
    round_ = SiteFinetuneRound(_SitesGrid(), [13], ["client 0 (node 13)"], [0], [1.0], timeout=30)
    with pytest.raises(RuntimeError, match="no site returned a fine-tuned model: client 0"):
        round_.run(fused)
