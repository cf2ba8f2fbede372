"""A deployed site's own data file, and how a site finds its identity and data."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from fedfuse.clients.site_context import site_identity
from fedfuse.data import DataFormatError, load_dataset, load_npz_dataset, save_npz_dataset
from fedfuse.federation.scenario import Scenario
from fedfuse.federation.site import SiteIdentity, train_site
from fedfuse.federation.site_data import load_site_data, site_part
from fedfuse.federation.site_score import score_on_site
from fedfuse.models import build_model
from tests.helpers import digits_settings, run_upload_request


def test_round_trip_keeps_images_labels_and_statistics(tmp_path):
    digits = load_dataset("digits", "train").subset(range(50))
    loaded = load_npz_dataset(save_npz_dataset(tmp_path / "site.npz", digits))
    assert torch.equal(loaded.images, digits.images) and torch.equal(loaded.labels, digits.labels)
    assert loaded.num_classes == 10 and loaded.mean == pytest.approx(digits.mean)
    assert torch.allclose(loaded.inputs(), digits.inputs())


def test_channels_last_images_and_measured_statistics(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (6, 5, 5, 3), dtype=np.uint8)
    np.savez(tmp_path / "site.npz", images=images, labels=np.arange(6) % 2, num_classes=4)
    site = load_npz_dataset(tmp_path / "site.npz")
    assert site.input_shape == (3, 5, 5) and site.num_classes == 4
    assert np.allclose(site.mean, images.mean(axis=(0, 1, 2)) / 255)
    assert torch.equal(site.images[2, 1], torch.from_numpy(images[2, :, :, 1]))


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (
            {"images": np.zeros((2, 4, 4), np.uint8), "labels": np.zeros(2, int)},
            r"lacks \['num_classes'\]",
        ),
        (
            {"images": np.zeros((2, 4, 4)), "labels": np.zeros(2, int), "num_classes": 2},
            "'images' must be uint8",
        ),
        (
            {"images": np.zeros((2, 4, 4), np.uint8), "labels": np.array([0, 5]), "num_classes": 3},
            "labels span 0..5, num_classes is 3",
        ),
    ],
)
def test_bad_site_files_name_the_file_and_key(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataFormatError, match=message) as info:
        load_npz_dataset(path)
    assert "bad.npz" in str(info.value)


def test_pickled_or_corrupt_site_files_are_refused(tmp_path):
    objects = tmp_path / "objects.npz"
    np.savez(
        objects, images=np.array([object()], dtype=object), labels=np.zeros(1, int), num_classes=1
    )
    with pytest.raises(DataFormatError, match="objects.npz"):
        load_npz_dataset(objects)
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DataFormatError, match="corrupt.npz: not a readable"):
        load_npz_dataset(corrupt)
    with pytest.raises(FileNotFoundError, match="absent.npz"):
        load_npz_dataset(tmp_path / "absent.npz")


def _context(node_config):
    return Context(run_id=1, node_id=42, node_config=node_config, state=RecordDict(), run_config={})


def test_site_identity_from_node_config():
    assert site_identity(_context({"partition-id": 1, "num-partitions": 2})) == (1, 2, None)
    assert site_identity(_context({"partition-id": 3, "data-path": "/d/s.npz"})) == (
        3,
        0,
        "/d/s.npz",
    )
    with pytest.raises(ValueError, match="node 42: node config needs an integer partition-id"):
        site_identity(_context({"data-path": "/d/s.npz"}))
    with pytest.raises(ValueError, match="neither data-path nor num-partitions"):
        site_identity(_context({"partition-id": 0}))


def test_a_deployed_site_trains_on_its_own_file(tmp_path):
    settings = digits_settings(local_epochs=1, score_samples=16, score_steps=2)
    own = Scenario(settings, 2).client_data(1)
    path = save_npz_dataset(tmp_path / "site1.npz", own)
    site = SiteIdentity(1, 0, data_path=str(path))
    upload = train_site(settings, site, run_upload_request(settings))
    assert upload.num_examples == len(own) and upload.num_partitions == 0
    assert upload.class_counts == torch.bincount(own.labels, minlength=10).tolist()
    assert upload.model.spec == settings.model_spec_for(own)


def test_a_validation_share_holds_rows_out_of_training_per_class_and_the_site_scores_on_them():
    settings = digits_settings(validation_share=0.25)
    own = Scenario(settings, 2).client_data(1)
    train, held = site_part(own, settings, 1), site_part(own, settings, 1, "validation")
    assert len(train) + len(held) == len(own) and len(held) > 0
    rows = {tuple(r.flatten().tolist()) for r in torch.cat([train.images, held.images])}
    assert len(rows) == len({tuple(r.flatten().tolist()) for r in own.images})  # disjoint, all
    counts = torch.bincount(own.labels, minlength=10)
    held_counts = torch.bincount(held.labels, minlength=10)
    expected = torch.minimum(torch.floor(0.25 * counts + 0.5).long(), (counts - 1).clamp(min=0))
    assert torch.equal(held_counts, expected)
    # deterministic per site; another site draws its own rows
    assert torch.equal(site_part(own, settings, 1, "validation").images, held.images)
    assert not torch.equal(site_part(own, settings, 0, "validation").images, held.images)
    # the site trains on (and counts) the other rows, and scores a model on the held-out ones
    site = SiteIdentity(1, 2)
    assert len(load_site_data(settings, 1, 2)) == len(train)
    upload = train_site(
        replace(settings, local_epochs=1, score_samples=16, score_steps=2),
        site,
        run_upload_request(settings),
    )
    assert upload.num_examples == len(train)
    assert upload.class_counts == torch.bincount(train.labels, minlength=10).tolist()
    assert score_on_site(settings, upload.model, site).examples == len(held)
    # without a share both parts are every row
    plain = digits_settings()
    assert site_part(own, plain, 1) is own and site_part(own, plain, 1, "validation") is own
    with pytest.raises(ValueError, match="part must be"):
        site_part(own, plain, 1, "test")


def test_a_site_with_no_row_held_out_refuses_to_score_naming_why(tmp_path):
    one_each = load_dataset("digits", "train")
    rows = [int((one_each.labels == c).nonzero()[0]) for c in range(3)]
    path = save_npz_dataset(tmp_path / "site.npz", one_each.subset(rows))
    settings = digits_settings(validation_share=0.5)
    site = SiteIdentity(0, 0, data_path=str(path))
    model = build_model(settings.model_spec_for(one_each), seed=0)
    with pytest.raises(ValueError, match=r"no row to score the model on: validation-share=0.5"):
        score_on_site(settings, model, site)
