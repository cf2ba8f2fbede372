"""Fusion speed and memory benchmark: wall time and peak memory of fusing two (or N) models.

Timing does not need trained models: the fused models are independently initialised and the
fusion set is random. The default reproduces the shapes of the paper's runtime experiment (two
VGG11s, the run default of :data:`~fedfuse.settings.run.DEFAULT_FUSION_SAMPLES` samples of
32x32x3; App. F.5 Table 10), whose GPU times are shown next to ours as a ratio. ``--arch resnet``
(ResNet-18, width 1, CIFAR stem) and ``--arch vit`` (the paper's CIFAR ViT) benchmark every
registered method that accepts the architecture (``--methods all``, their default); methods
that refuse it are listed with the reason, and a method that raises is reported as FAILED while
the others go on. ``--arch torchvision-resnet18`` fuses torchvision's ``resnet18`` as a user's
plain model, then fedfuse's own ResNet-18 of the same layers, and prints the two side by side
with their ratio (:mod:`fedfuse.experiments.speed_plain`). Statistics-round methods get two
in-process sites holding the two halves of the fusion set; their statistics are part of the
timed fusion.

Each method runs ``repeats`` times in this process; the median wall time of
:meth:`~fedfuse.fusion.base.FusionMethod.fuse` is reported (CUDA synchronised), with the peak
RSS of the process and, on CUDA, the peak allocated GPU memory while that method ran.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import logging
import resource
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from fedfuse.experiments.speed_options import ARCHS as ARCHS  # light, for the CLI
from fedfuse.experiments.speed_options import DEFAULT_METHODS, PLAIN_ARCHS
from fedfuse.experiments.speed_plain import compare, format_comparison, own_counterpart, plain_spec
from fedfuse.fusion import FusionInputs, make_fusion_method, parse_options
from fedfuse.fusion.base import FusionMethod, reads_sites
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.fusion.registry import FUSION_METHODS, parse_method_names, split_method_options
from fedfuse.fusion.statistics.channels import LocalSites
from fedfuse.fusion.statistics.fisher import site_fisher
from fedfuse.models import LeveledModel, ModelSpec, build_model, make_spec
from fedfuse.runtime import PeakMemory, release_free_memory, resolve_device
from fedfuse.settings.bounds import DEFAULT_MAX_FUSED_PARAMETERS, check_model_size
from fedfuse.settings.run import DEFAULT_FUSION_SAMPLES

log = logging.getLogger(__name__)

#: The paper's Table 10 (seconds, VGG11 on CIFAR-10, 400 samples, uniform scores, RTX A5000).
PAPER_VGG11_SECONDS = {"hf-linear": 14.2, "kf-linear": 78.3, "kf-gradient": 16.5}
#: the architecture options of ``resnet`` and ``vit`` unless ``model_options`` set them
#: (resnet: ResNet-18 at width 1, its stem the CIFAR one on inputs up to 64 pixels; vit: the
#: spec builder's defaults, the paper's CIFAR ViT)
DEFAULT_MODEL_OPTIONS: dict[str, dict[str, Any]] = {
    "resnet": {"depth": 18, "width_multiplier": 1.0},
    "vit": {},
    "lenet5": {},
}
#: the :class:`FusionInputs` fields the benchmark builds (Grams only when a method reads them)
PROVIDED_INPUTS = frozenset(
    {"data", "labels", "sample_counts", "class_counts", "grams", "fisher", "sites"}
)
NUM_CLASSES = 10


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far, in GiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def benchmark_spec(
    arch: str,
    input_shape: tuple[int, ...] = (3, 32, 32),
    width: float = 1.0,
    model_options: dict[str, Any] | None = None,
) -> ModelSpec:
    """The spec of the fused models: ``width`` is vgg11's width multiplier or the mlp's hidden
    width (3 levels); resnet and vit start from :data:`DEFAULT_MODEL_OPTIONS`; ``model_options``
    (the spec builder's keyword arguments) override any of these. A plain model
    (:data:`~fedfuse.experiments.speed_options.PLAIN_ARCHS`) has the widths its class defines:
    it takes neither."""
    if arch in PLAIN_ARCHS:
        if model_options:
            raise ValueError(f"{arch} has the widths its class defines; got {model_options}")
        return plain_spec(arch, input_shape, NUM_CLASSES)
    if arch == "vgg11":
        arch_options: dict[str, Any] = {"width_multiplier": width}
    elif arch == "mlp":
        arch_options = {"widths": (int(width),) * 3}
    else:
        arch_options = dict(DEFAULT_MODEL_OPTIONS.get(arch, {}))
    arch_options.update(model_options or {})
    return make_spec(arch, input_shape, NUM_CLASSES, **arch_options)


def resolve_methods(methods: Sequence[str] | str) -> list[str]:
    """Method names from a list or comma string; ``all`` is every registered method."""
    names = parse_method_names(methods) if isinstance(methods, str) else list(methods)
    if "all" in names:
        names = [n for n in names if n != "all"] + sorted(FUSION_METHODS)
        names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in FUSION_METHODS]
    if unknown:
        raise ValueError(f"unknown fusion method(s) {unknown}; known: {sorted(FUSION_METHODS)}")
    if not names:
        raise ValueError("no fusion method named")
    return names


def split_options(names: Sequence[str], assignments: str) -> dict[str, dict[str, Any]]:
    """Per method, its options from ``"k=v method.k=v ..."`` (see
    :func:`~fedfuse.fusion.registry.split_method_options`)."""
    return split_method_options(names, assignments)


def _benchmark_inputs(models: list[LeveledModel], samples: int) -> FusionInputs:
    """A random fusion set (seed 0) with random labels; equal sample counts; each model's
    class counts those of the labels."""
    shape = tuple(models[0].spec.input_shape)
    data = torch.randn(samples, *shape, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, NUM_CLASSES, (samples,), generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(labels, minlength=NUM_CLASSES).tolist()
    return FusionInputs(
        data=data,
        labels=labels,
        sample_counts=[1] * len(models),
        class_counts=[counts] * len(models),
    )


def _grams(models: list[LeveledModel], data: torch.Tensor, device: torch.device) -> list[Any]:
    """Each model's RegMean Grams on the fusion set (the sites' work: not timed)."""
    started = time.perf_counter()
    grams = [level_grams(copy.deepcopy(m).to(device), data) for m in models]
    log.info(
        "Gram matrices of %d models in %.2f s (not timed)",
        len(models),
        time.perf_counter() - started,
    )
    return grams


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _unrun(name: str, status: str, note: str) -> dict[str, Any]:
    """The row of a method that did not run (refused, skipped) or raised (failed)."""
    log.warning("%s %s: %s", name, status, note)
    return {"method": name, "status": status, "note": note, "seconds": None, "all_seconds": []}


def _time_method(
    method: FusionMethod,
    models: list[LeveledModel],
    inputs: FusionInputs,
    repeats: int,
    device: torch.device,
) -> tuple[list[float], PeakMemory]:
    """Wall seconds of each of ``repeats`` fusions, and the peak memory while they ran."""
    _free(device)
    seconds = []
    with PeakMemory() as peak:
        for _ in range(repeats):
            _synchronize(device)
            started = time.perf_counter()
            result = method.fuse(models, inputs)
            _synchronize(device)
            seconds.append(time.perf_counter() - started)
            del result
    return seconds, peak


def measure(
    methods: Sequence[str] | str,
    *,
    arch: str = "vgg11",
    input_shape: tuple[int, ...] = (3, 32, 32),
    width: float = 1.0,
    model_options: dict[str, Any] | None = None,
    fusion_samples: int = DEFAULT_FUSION_SAMPLES,
    repeats: int = 1,
    device: str = "auto",
    options: dict[str, dict[str, Any]] | None = None,
    count: int = 2,
) -> list[dict[str, Any]]:
    """Fuse ``count`` (default two) independently initialised models with each method
    (``all``: every registered one); one row per method.

    A row has ``method``, ``status`` (``ok``; ``refused``: the method cannot fuse this
    architecture; ``skipped``: it needs inputs the benchmark does not build; ``failed``: it
    raised) and ``note`` (the reason, or what was special about its inputs); an ``ok`` row also
    ``seconds`` (median), ``all_seconds``, ``peak_rss_gib`` (the process's peak RSS while the
    method ran), ``rss_increase_gib`` (that peak over the RSS when it started),
    ``peak_cuda_gib`` (peak allocated, on CUDA; else None), ``paper_seconds`` and
    ``ratio_to_paper`` (the paper's VGG11 setting only). Methods whose constructor takes a
    ``device`` get ``device`` unless ``options`` (per method) set it.
    """
    if repeats < 1 or fusion_samples < 1 or count < 2:
        raise ValueError(
            f"need repeats >= 1, fusion_samples >= 1 and count >= 2 models, got {repeats}, "
            f"{fusion_samples}, {count}"
        )
    names = resolve_methods(methods)
    torch_device = resolve_device(device)
    spec = benchmark_spec(arch, input_shape, width, model_options)
    models = [build_model(spec, seed=s) for s in range(1, count + 1)]
    inputs = _benchmark_inputs(models, fusion_samples)
    paper_spec = make_spec("vgg11", (3, 32, 32), NUM_CLASSES, width_multiplier=1.0)
    paper_setting = count == 2 and spec == paper_spec
    rows = []
    for name in names:
        accepted = FUSION_METHODS[name].accepted_options()
        method_options = {"device": device} if "device" in accepted else {}
        method_options.update((options or {}).get(name, {}))
        method = make_fusion_method(name, **method_options)
        try:
            method.check_run(count, spec, available=None)
        except ValueError as error:
            rows.append(_unrun(name, "refused", str(error)))
            continue
        try:
            method.check_run(count, available=PROVIDED_INPUTS)
        except ValueError as error:
            rows.append(_unrun(name, "skipped", str(error)))
            continue
        notes, method_inputs = [], inputs
        if "grams" in method.needs():  # built for this method alone, so later RSS omits them
            grams = _grams(models, inputs.data, torch_device)
            method_inputs = dataclasses.replace(inputs, grams=grams)
            notes.append("Grams on the fusion set, not timed")
        if "fisher" in method.needs():  # the sites' work, on the fusion set: not timed
            kinds = getattr(method, "fisher_kinds", ())
            fisher = [
                site_fisher(copy.deepcopy(m), inputs.data, kinds, device=device) for m in models
            ]
            method_inputs = dataclasses.replace(method_inputs, fisher=fisher)
            notes.append("Fisher on the fusion set, not timed")
        if reads_sites(method.needs()):  # the sites' work (statistics, scores) is timed
            assert inputs.data is not None and inputs.labels is not None
            parts = list(inputs.data.tensor_split(count))
            labelled = list(zip(parts, inputs.labels.tensor_split(count), strict=True))
            sites = LocalSites(models, parts, device=torch_device, validation=labelled)
            method_inputs = dataclasses.replace(method_inputs, sites=sites)
            notes.append(f"{count} sites in-process on parts of the fusion set, their work timed")
        if "labels" in method.needs():
            notes.append("random labels")
        log.info("%s: fusing %d times", name, repeats)
        try:
            seconds, peak = _time_method(method, models, method_inputs, repeats, torch_device)
        except Exception as error:  # noqa: BLE001 - reported, the other methods go on
            log.debug("%s raised", name, exc_info=True)
            rows.append(_unrun(name, "failed", f"{type(error).__name__}: {error}"))
            continue
        finally:
            del method_inputs
            _free(torch_device)
        median = statistics.median(seconds)
        paper = PAPER_VGG11_SECONDS.get(name) if paper_setting else None
        on_cuda = torch_device.type == "cuda" and peak.cuda_mib is not None
        cuda = peak.cuda_mib / 1024 if on_cuda else None
        rows.append(
            {
                "method": name,
                "status": "ok",
                "note": "; ".join(notes),
                "seconds": median,
                "all_seconds": seconds,
                "paper_seconds": paper,
                "ratio_to_paper": median / paper if paper else None,
                "peak_rss_gib": peak.rss_mib / 1024,
                "rss_increase_gib": peak.extra_mib / 1024,
                "peak_cuda_gib": cuda,
            }
        )
        log.info(
            "%s: %.2f s (median of %d), peak RSS %.2f GiB%s",
            name,
            median,
            repeats,
            rows[-1]["peak_rss_gib"],
            f", peak CUDA {cuda:.2f} GiB" if cuda is not None else "",
        )
    return rows


def measure_alternating(
    methods: Sequence[str] | str,
    setups: Sequence[tuple[str, dict[str, Any]]],
    *,
    repeats: int = 1,
    **settings: Any,
) -> list[list[dict[str, Any]]]:
    """Each setup's rows (``(arch, model_options)``, rows as :func:`measure`'s), its repeats
    taken in turn with the other setups' (first, second, first, ...; each a :func:`measure` of
    one repeat), so that on a shared machine all see the same load and their ratio holds while
    the load drifts. A row's median is over its repeats, its peaks the highest of them."""
    if repeats < 1:
        raise ValueError(f"need repeats >= 1, got {repeats}")
    runs: list[list[list[dict[str, Any]]]] = [[] for _ in setups]
    for repeat in range(repeats):
        for number, (arch, model_options) in enumerate(setups):
            log.info("%s: repeat %d of %d", arch, repeat + 1, repeats)
            rows = measure(methods, arch=arch, model_options=model_options, **settings)
            runs[number].append(rows)
            release_free_memory()  # what these fusions freed, before the next setup's start
    return [[_merged(rows) for rows in zip(*setup, strict=True)] for setup in runs]


def _merged(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One method's rows of several :func:`measure` calls as one: the first that did not run,
    else the median seconds of all and the highest peaks."""
    unrun = [row for row in rows if row["status"] != "ok"]
    if unrun:
        return unrun[0]
    seconds = [s for row in rows for s in row["all_seconds"]]
    cuda = [row["peak_cuda_gib"] for row in rows if row["peak_cuda_gib"] is not None]
    return {
        **rows[0],
        "seconds": statistics.median(seconds),
        "all_seconds": seconds,
        "peak_rss_gib": max(row["peak_rss_gib"] for row in rows),
        "rss_increase_gib": max(row["rss_increase_gib"] for row in rows),
        "peak_cuda_gib": max(cuda) if cuda else None,
    }


def describe_spec(spec: ModelSpec) -> str:
    """``arch (options, widths, parameters)`` for the output's header."""
    model = build_model(spec, device="meta")
    parameters = sum(p.numel() for p in model.parameters())
    options = "".join(f"{k}={v}, " for k, v in spec.options.items())
    widths = list(spec.widths)
    if len(set(widths)) == 1:
        width_text = f"{len(widths)} x {widths[0]}"
    else:
        width_text = f"{widths}" if len(widths) <= 4 else f"{min(widths)}..{max(widths)}"
    return f"{spec.arch} ({options}widths {width_text}, {parameters:,} parameters)"


def device_description(device: str) -> str:
    """The resolved device, with the GPU's name on CUDA."""
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        return f"{resolved} ({torch.cuda.get_device_name(resolved)})"
    return f"{resolved} ({torch.get_num_threads()} threads)"


def format_speed_table(rows: list[dict[str, Any]], header: str) -> str:
    """A Markdown table of the methods that ran or failed, then the refused and skipped ones."""

    def gib(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    paper_columns = any(r.get("paper_seconds") for r in rows)
    columns = ["method", "seconds (median)", "peak RSS GiB", "peak CUDA GiB", "note"]
    if paper_columns:
        columns[2:2] = ["paper GPU seconds", "ratio"]
    lines = [header, "", "| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * 3]
    lines[-1] += " ---: |" * (2 if paper_columns else 0) + " --- |"
    for r in rows:
        if r["status"] not in ("ok", "failed"):
            continue
        ok = r["status"] == "ok"
        cells = [r["method"], f"{r['seconds']:.2f}" if ok else "FAILED"]
        if paper_columns:
            paper = r.get("paper_seconds")
            ratio = r.get("ratio_to_paper")
            cells += [f"{paper:.1f}" if paper else "-", f"{ratio:.2f}x" if ratio else "-"]
        cells += [gib(r.get("peak_rss_gib")), gib(r.get("peak_cuda_gib")), r["note"]]
        lines.append(
            "| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |"
        )
    unrun = [r for r in rows if r["status"] in ("refused", "skipped")]
    if unrun:
        lines += ["", "Not run:"]
        lines += [f"- {r['method']} ({r['status']}): {r['note']}" for r in unrun]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``fedfuse speed``: print the timing table."""
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = resolve_methods(args.methods or DEFAULT_METHODS.get(args.arch, "all"))
    options = split_options(methods, args.options)
    model_options = parse_options(args.model_options) if args.model_options else {}
    shape = tuple(int(d) for d in args.input_shape.split(","))
    spec = benchmark_spec(args.arch, shape, args.width, model_options)
    # before any model is allocated (--width 1e9 asked the allocator for 6.9 TB of vgg11)
    limit = "choose a smaller --width"
    check_model_size(spec, DEFAULT_MAX_FUSED_PARAMETERS, f"the benchmark's {spec.arch}", limit)
    described = device_description(args.device)
    log.info("benchmarking on %s: %s", described, spec.to_dict())
    settings = {
        "input_shape": shape,
        "fusion_samples": args.fusion_samples,
        "repeats": args.repeats,
        "device": args.device,
        "options": options,
        "count": args.models,
    }
    setting = (
        f"on {args.fusion_samples} samples of {args.input_shape}; {args.repeats} repeat(s); "
        f"device {described}"
    )
    if args.arch not in PLAIN_ARCHS:
        rows = measure(
            methods, arch=args.arch, width=args.width, model_options=model_options, **settings
        )
        print(format_speed_table(rows, f"fusing {args.models} x {describe_spec(spec)} {setting}"))
        return 0
    own_arch, own_options = own_counterpart(args.arch)
    own_spec = benchmark_spec(own_arch, shape, model_options=own_options)
    setups = [(args.arch, model_options), (own_arch, own_options)]
    rows, own_rows = measure_alternating(methods, setups, **settings)
    header = (
        f"fusing {args.models} x {describe_spec(spec)} and {args.models} x fedfuse's own "
        f"{describe_spec(own_spec)} in turn, {setting}; ratio: {args.arch}/{own_arch}, of the "
        "RSS increase for memory"
    )
    print(format_comparison(compare(rows, own_rows), header, (args.arch, own_arch)))
    return 0
