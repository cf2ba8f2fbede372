"""Fusion on CUDA (skipped where there is no GPU: the development machines and CI have none).

Every registered method that accepts an architecture fuses tiny models with ``device="cuda"``
without a tensor left on the wrong device, and the closed-form methods give the CPU's model
(the same fit; only the order of floating-point sums differs).
"""

from __future__ import annotations

import copy

import pytest
import torch

from fedfuse.experiments import speed
from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.fusion.statistics.channels import LocalSites
from fedfuse.fusion.statistics.fisher import FISHER_KINDS, site_fisher
from fedfuse.models import build_model, make_spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ARCHITECTURES = {
    "mlp": ((1, 8, 8), {"widths": (16, 12)}),
    "resnet": ((3, 16, 16), {"depth": 10, "width_multiplier": 0.125}),
    "vit": ((3, 16, 16), {"patch": 4, "depth": 1, "heads": 2, "hidden": 16, "mlp": 16}),
}
#: methods whose fit is deterministic given the inputs, so CUDA must give the CPU's model
CLOSED_FORM = (
    "vanilla",
    "fedavg",
    "regmean",
    "hf-linear",
    "kf-linear",
    "hf-sites",
    "kf-sites",
    "fisher-merging",
    "fedfisher-diag",
    "fedfisher-kfac",
)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_accepting_method_fuses_on_cuda(arch):
    shape, options = ARCHITECTURES[arch]
    rows = speed.measure(
        "all",
        arch=arch,
        input_shape=shape,
        model_options=options,
        fusion_samples=48,
        device="cuda",
    )
    failed = [f"{r['method']}: {r['note']}" for r in rows if r["status"] == "failed"]
    assert not failed, failed
    assert any(r["status"] == "ok" for r in rows)


def _inputs(models, data, device):
    labels = torch.randint(0, 10, (len(data),), generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(labels, minlength=10).tolist()
    halves = list(data.tensor_split(len(models)))
    return FusionInputs(
        data=data,
        labels=labels,
        sample_counts=[1] * len(models),
        class_counts=[counts] * len(models),
        grams=[level_grams(copy.deepcopy(m), data) for m in models],
        fisher=[site_fisher(copy.deepcopy(m), data, FISHER_KINDS, device=device) for m in models],
        sites=LocalSites(models, halves, device=device),
    )


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("name", CLOSED_FORM)
def test_closed_form_fusion_on_cuda_equals_the_cpu(arch, name):
    shape, options = ARCHITECTURES[arch]
    spec = make_spec(arch, shape, 10, **options)
    method = make_fusion_method(name)
    try:
        method.check_run(2, spec, available=None)
    except ValueError:
        pytest.skip(f"{name} does not fuse {arch}")
    models = [build_model(spec, seed=s) for s in (1, 2)]
    data = torch.randn(64, *shape, generator=torch.Generator().manual_seed(0))
    fused = {}
    for device in ("cpu", "cuda"):
        accepted = type(method).accepted_options()
        chosen = make_fusion_method(name, **({"device": device} if "device" in accepted else {}))
        result = chosen.fuse([copy.deepcopy(m) for m in models], _inputs(models, data, device))
        fused[device] = result.model.to("cpu").eval()
    with torch.no_grad():
        cpu, cuda = fused["cpu"](data), fused["cuda"](data)
    assert torch.isfinite(cuda).all()
    scale = cpu.abs().max().clamp_min(1e-6)
    assert float((cpu - cuda).abs().max() / scale) < 1e-2, (name, arch)
