"""Samples from the user's own containers, and the extras a plain ClientApp computes."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fedfuse.data.tensors import collect_samples
from fedfuse.experiments.plain_models import TemplateNet
from fedfuse.federation.plain_site import compute_site_extras
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.io.grams import full_gram
from fedfuse.models import ModelAdapter

pytestmark = pytest.mark.usefixtures("one_thread")


def _samples(n=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=generator), torch.arange(n) % 10


def test_every_container_gives_the_same_samples():
    x, y = _samples()
    loader = DataLoader(TensorDataset(x, y), batch_size=7)
    dicts = [{"img": a, "label": b} for a, b in loader]
    for source in (loader, (x, y), dicts):
        inputs, labels = collect_samples(source)
        assert torch.equal(inputs, x) and torch.equal(labels, y)
    inputs, labels = collect_samples(loader, limit=10)
    assert torch.equal(inputs, x[:10]) and torch.equal(labels, y)  # labels: all of them
    inputs, labels = collect_samples(x)
    assert torch.equal(inputs, x) and labels is None


def test_unreadable_batches_are_named():
    x, y = _samples(8)
    with pytest.raises(ValueError, match="cannot tell inputs from labels"):
        collect_samples([{"a": x, "b": x.clone(), "label": y}], what="the fusion set")
    with pytest.raises(ValueError, match=r"the fusion set, batch 0: no key\(s\) \['pixels'\]"):
        collect_samples([{"img": x, "label": y}], keys=("pixels", "label"), what="the fusion set")
    with pytest.raises(ValueError, match="inputs must be a float tensor"):
        collect_samples([(x.to(torch.uint8), y)])
    with pytest.raises(ValueError, match="holds no samples"):
        collect_samples([])


def test_site_extras_are_those_of_the_adapted_model():
    torch.manual_seed(0)
    net = TemplateNet()
    x, y = _samples(30)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    extras = compute_site_extras(
        net, loader, ["scores", "class-counts", "grams"], score_samples=12, score_steps=2
    )
    leveled = ModelAdapter(TemplateNet, (1, 28, 28)).adapt(net)
    assert extras.class_counts == torch.bincount(y, minlength=10).tolist()
    assert sorted(extras.scores) == sorted(leveled.neuron_levels)
    for level, scores in extras.scores.items():
        assert scores.shape == (leveled.level_width(level),) and bool((scores >= 0).all())
    expected = level_grams(leveled, x)
    assert sorted(extras.grams) == sorted(expected)
    for level, gram in expected.items():
        assert torch.allclose(full_gram(extras.grams[level]), gram)  # 30 rows: a factor
    assert net.training  # left as it was
    assert compute_site_extras(net, loader, []).scores is None
    with pytest.raises(ValueError, match="unknown site extras"):
        compute_site_extras(net, loader, ["weights"])
