"""`fedfuse report` on a tiny synthetic sweep: tables by hand, CSV, failures, figures, CLI."""

from __future__ import annotations

import copy
import csv
import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from fedfuse.experiments.diagnostics import load_weight_vector, weight_vector
from fedfuse.experiments.report.document import (
    DiagnosticsOptions,
    Stat,
    SweepModels,
    choose_landscape_rows,
    format_stat,
    human_bytes,
    load_sweep,
    main,
    write_report,
)
from fedfuse.experiments.report.rows import summarize
from fedfuse.experiments.report.tables import format_results_markdown, summary_records
from fedfuse.io.checkpoint import load_checkpoint, save_checkpoint
from fedfuse.models import build_model, make_spec

SPEC = make_spec("mlp", (1, 8, 8), 10, widths=(16, 12))
EXPERIMENT = "digits-mlp"
UPLOAD = 4000

# accuracies by (partition, sites, seed): base mean, ensemble, and per method
ACCURACY = {
    ("sharded", 2, 0): {"base": 0.50, "ensemble": 0.90, "kf-linear": 0.80, "fedavg": 0.30},
    ("sharded", 2, 1): {"base": 0.40, "ensemble": 0.80, "kf-linear": 0.70, "fedavg": 0.25},
    ("sharded", 3, 0): {"base": 0.35, "ensemble": 0.85, "kf-linear": 0.60, "fedavg": 0.20},
    ("iid", 2, 0): {"base": 0.70, "ensemble": 0.75, "kf-linear": 0.72, "fedavg": 0.50},
}


def _site_set(directory: Path, partition: str, sites: int, seed: int) -> Path:
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 30, (sites, 10), generator=generator).tolist()
    for k in range(sites):
        model = build_model(SPEC, seed=1000 * len(partition) + 100 * seed + k)
        scores = {
            str(level): torch.rand(model.level_width(level), generator=generator).tolist()
            for level in model.neuron_levels
        }
        save_checkpoint(
            directory / f"site_{k}.safetensors", model, metadata={"scores": {"conductance": scores}}
        )
    document = {
        "format": "fedfuse-site-set/1",
        "settings": _settings(partition, seed),
        "num_sites": sites,
        "class_counts": counts,
        "num_examples": [sum(c) for c in counts],
        "evaluation": {},
        "upload_bytes": [UPLOAD] * sites,
    }
    (directory / "site_set.json").write_text(json.dumps(document))
    return directory


def _settings(partition: str, seed: int) -> dict:
    return {"dataset": "digits", "partitioner": partition, "seed": seed, "mlp-widths": "16,12"}


def _fused(site_dir: Path, sites: int, shift: float) -> torch.nn.Module:
    """The sites' average, moved off their line so that the three models span a plane."""
    models = [load_checkpoint(site_dir / f"site_{k}.safetensors").model for k in range(sites)]
    fused = copy.deepcopy(models[0])
    vector = sum(weight_vector(m) for m in models) / sites
    noise = torch.randn(vector.shape, generator=torch.Generator().manual_seed(7)).double()
    return load_weight_vector(fused, vector + shift * noise)


def _row(row_id: str, partition: str, sites: int, seed: int, method: str, **fields) -> dict:
    acc = ACCURACY[(partition, sites, seed)]
    return {
        "format": "fedfuse-compare-row/1",
        "row_id": row_id,
        "status": "ok",
        "error": None,
        "experiment": EXPERIMENT,
        "dataset": "digits",
        "model": "mlp",
        "partition": partition,
        "sites": sites,
        "seed": seed,
        "scores": "conductance",
        "method": method,
        "label": method,
        "kind": "fusion",
        "options": {},
        "accuracy": acc.get(method),
        "loss": 1.0,
        "base_accuracies": [acc["base"]] * sites,
        "base_mean_accuracy": acc["base"],
        "ensemble_accuracy": acc["ensemble"],
        "ensemble_loss": 0.5,
        "fusion_seconds": {"kf-linear": 1.5 + seed, "fedavg": 0.01}.get(method, 2.0),
        "upload_bytes_per_site": [UPLOAD] * sites,
        "test_examples": 360,
        "fused_checkpoint": f"fused/{row_id}.safetensors",
        "runner": "library",
        "settings": _settings(partition, seed),
        **fields,
    }


def build_sweep(root: Path) -> Path:
    """A sweep of real tiny models: 4 site sets, 2 methods each; one failed job, two jobs whose
    fused model is missing, one whose fused model is corrupt, one unreadable row file, and an
    experiment whose site set is gone."""
    sweep = root / "sweep"
    (sweep / "rows").mkdir(parents=True)
    (sweep / "fused").mkdir()
    rows = []
    for partition, sites, seed in ACCURACY:
        site_dir = _site_set(root / "sites" / f"{partition}-{sites}-{seed}", partition, sites, seed)
        for method, shift in (("kf-linear", 0.05), ("fedavg", 0.0)):
            row_id = f"{partition}-{sites}-{seed}-{method}"
            row = _row(row_id, partition, sites, seed, method, site_set_dir=str(site_dir))
            rows.append(row)
            if (partition, sites, seed, method) == ("sharded", 3, 0, "kf-linear"):
                row["fused_checkpoint"] = None  # lost: the diagnostics skip it
                continue
            # fedavg: the exact average of two sites is on their line, so give it a small shift
            save_checkpoint(
                sweep / "fused" / f"{row_id}.safetensors",
                _fused(site_dir, sites, shift or 0.01),
            )
    failed = _row(
        "sharded-2-1-hf", "sharded", 2, 1, "hf-linear", site_set_dir=rows[0]["site_set_dir"]
    )
    failed |= {"status": "failed", "error": "hf-linear: boom | out of memory", "accuracy": None}
    failed |= {"fused_checkpoint": None, "fusion_seconds": None}
    ok_hf = _row(
        "sharded-2-0-hf", "sharded", 2, 0, "hf-linear", site_set_dir=rows[0]["site_set_dir"]
    )
    ok_hf |= {"accuracy": 0.60, "fused_checkpoint": None}
    (sweep / "fused" / "iid-2-0-fedavg.safetensors").write_bytes(b"not a checkpoint")
    lost = _row("lost", "iid", 2, 0, "kf-linear", site_set_dir=str(root / "gone"))
    lost |= {"experiment": "digits-lost", "fused_checkpoint": None}
    for row in [*rows, failed, ok_hf, lost]:
        (sweep / "rows" / f"{row['row_id']}.json").write_text(json.dumps(row))
    (sweep / "rows" / "broken.json").write_text("{not json")
    return sweep


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    sweep = build_sweep(tmp_path_factory.mktemp("report"))
    options = DiagnosticsOptions(
        landscape_grid=5, landscape_samples=120, landscape_max_rows=4, progress=False
    )
    files = write_report(sweep, options=options)
    return sweep, files


def _std(*values: float) -> float:
    return statistics.stdev(values)


def test_the_report_writes_its_files(report):
    sweep, files = report
    assert files.directory == sweep / "report"
    assert files.markdown == sweep / "report" / "results.md" and files.markdown.is_file()
    assert files.csv == sweep / "report" / "results.csv" and files.csv.is_file()
    assert files.weight_stats_csv == sweep / "report" / "weight_stats.csv"
    assert files.rows == 11 and files.failed == 1
    names = {p.name for p in files.figures}
    assert {
        f"accuracy_bars_{EXPERIMENT}.png",
        f"accuracy_vs_sites_{EXPERIMENT}.png",
        f"gap_vs_sites_{EXPERIMENT}.png",
        "class_counts_digits-mlp_sharded_2sites_seed0.png",
        "class_counts_digits-mlp_sharded_3sites_seed0.png",
        "class_counts_digits-mlp_iid_2sites_seed0.png",
        "importance_digits-mlp_sharded_conductance_2sites_seed0.png",
        "weight_stats_digits-mlp_iid_conductance_2sites_seed0.png",
        "templates_digits-mlp_sharded_conductance_2sites_seed0.png",
        "landscape_sharded-2-0-kf-linear.png",
        "landscape_iid-2-0-kf-linear.png",
    } <= names
    for path in files.figures:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
        assert path.parent == files.directory / "figures"
    md = files.markdown.read_text()
    for path in files.figures:
        assert f"](figures/{path.name})" in md


def test_markdown_has_mean_and_std_computed_by_hand(report):
    _, files = report
    md = files.markdown.read_text()
    kf = f"75.00 ± {_std(80, 70):.2f} (n=2)"  # sharded, 2 sites, seeds 0 and 1
    assert f"| kf-linear | conductance | fusion | {kf} | 60.00 ± – (n=1) |" in md
    base = f"45.00 ± {_std(50, 40):.2f} (n=2)"
    assert f"| base models (mean) | – | reference | {base} | 35.00 ± – (n=1) |" in md
    assert f"| ensemble | – | reference | 85.00 ± {_std(90, 80):.2f} (n=2) |" in md
    # one seed failed, one ok; a column the method never ran in stays empty
    assert "| hf-linear | conductance | fusion | 60.00 ± – (n=1, 1 failed) |  |" in md
    # the gap: ensemble minus method, per seed (90-80, 80-70) -> 10 ± 0
    assert "| kf-linear | conductance | fusion | 10.00 ± 0.00 (n=2) | 25.00 ± – (n=1) |" in md
    # cost: seconds and human-readable upload
    assert f"| kf-linear | conductance | fusion | 2.00 ± {_std(1.5, 2.5):.2f} s · 3.9 KiB |" in md
    assert "### digits · mlp · sharded (experiment `digits-mlp`)" in md
    assert "### digits · mlp · iid (experiment `digits-mlp`)" in md


def test_failed_jobs_and_unreadable_rows_are_listed(report):
    _, files = report
    md = files.markdown.read_text()
    assert "## Failed jobs (1)" in md
    error = "hf-linear: boom \\| out of memory"
    assert f"| sharded-2-1-hf | digits-mlp | sharded | 2 | 1 | hf-linear | {error} |" in md
    assert "broken.json: unreadable" in md
    assert "1 failed" in md.splitlines()[2]


def test_missing_checkpoints_are_skipped_and_said(report):
    _, files = report
    skipped = files.markdown.read_text().split("## Skipped")[1]
    assert "sharded-2-0-hf (hf-linear): no checkpoint in the sweep" in skipped
    assert "iid-2-0-fedavg (fedavg):" in skipped and "not a readable safetensors" in skipped
    # the lost site set: its table is there, its model figures are skipped, naming the file
    assert "gone/site_set.json: no such site-set file" in skipped
    assert "class distribution of digits-lost" in skipped
    assert "### digits · mlp · iid (experiment `digits-lost`)" in files.markdown.read_text()


def test_csv_parses_with_raw_numbers(report):
    _, files = report
    with files.csv.open() as handle:
        rows = list(csv.DictReader(handle))
    by_key = {(r["partition"], r["label"], int(r["sites"])): r for r in rows}
    kf = by_key[("sharded", "kf-linear", 2)]
    assert float(kf["accuracy_pct_mean"]) == pytest.approx(75.0)
    assert float(kf["accuracy_pct_std"]) == pytest.approx(_std(80, 70))
    assert kf["n"] == "2" and kf["failed"] == "0" and kf["seeds"] == "0 1"
    assert int(kf["upload_bytes_per_site_mean"]) == UPLOAD
    assert float(kf["gap_pp_mean"]) == pytest.approx(10.0)
    single = by_key[("sharded", "kf-linear", 3)]
    assert single["accuracy_pct_std"] == "" and single["n"] == "1"
    hf = by_key[("sharded", "hf-linear", 2)]
    assert hf["failed"] == "1" and hf["n"] == "1"
    assert by_key[("sharded", "base models (mean)", 2)]["kind"] == "reference"
    assert float(by_key[("iid", "ensemble", 2)]["accuracy_pct_mean"]) == pytest.approx(75.0)


def test_weight_stats_and_landscape_data(report):
    _, files = report
    with files.weight_stats_csv.open() as handle:
        stats = list(csv.DictReader(handle))
    names = {r["model_name"] for r in stats if r["partition"] == "sharded"}
    assert names == {"site 0", "site 1", "fused: kf-linear", "fused: fedavg"}
    names = {r["model_name"] for r in stats if r["partition"] == "iid"}
    assert names == {"site 0", "site 1", "fused: kf-linear"}  # fedavg's file is corrupt
    assert {r["level"] for r in stats} == {"0", "2", "4"}
    assert all(math.isfinite(float(r["norm"])) for r in stats)
    # the default landscape method is the most accurate fusion method (kf-linear)
    assert {p.name for p in files.landscapes} == {
        "sharded-2-0-kf-linear.json",
        "iid-2-0-kf-linear.json",
    }
    data = json.loads(files.landscapes[0].read_text())
    assert len(data["loss"]) == 5 and len(data["loss"][0]) == 5 and data["samples"] == 120
    assert data["anchors_named"][2] == "fused: kf-linear"


def test_landscape_rows_one_per_configuration_of_the_chosen_method(tmp_path):
    sweep = load_sweep(build_sweep(tmp_path))
    models = SweepModels(sweep)
    rows, notes = choose_landscape_rows(sweep.rows, "fedavg", models, limit=1)
    # iid's fedavg file exists (corrupt: the landscape itself will be skipped)
    assert [r["row_id"] for r in rows] == ["iid-2-0-fedavg"]
    assert notes == ["landscapes: 1 of 2 configurations left out (landscape_max_rows=1)"]
    rows, notes = choose_landscape_rows(sweep.rows, None, models, limit=4)
    assert [r["row_id"] for r in rows] == ["iid-2-0-kf-linear", "sharded-2-0-kf-linear"]
    rows, notes = choose_landscape_rows(sweep.rows, "otfusion", models, limit=4)
    assert rows == [] and "'otfusion'" in notes[0]


def test_cli_entry_point_without_diagnostics(tmp_path, capsys):
    sweep = build_sweep(tmp_path)
    out = tmp_path / "tables"
    assert main([str(sweep), "--out", str(out), "--no-diagnostics"]) == 0
    assert (out / "results.md").is_file() and (out / "results.csv").is_file()
    assert not (out / "weight_stats.csv").exists()
    assert "1 of 11 jobs failed" in capsys.readouterr().out
    assert main([str(tmp_path / "nowhere")]) == 2


def test_load_sweep_and_formatting_helpers(tmp_path):
    directory = build_sweep(tmp_path)
    sweep = load_sweep(directory)
    assert len(sweep.rows) == 11 and len(sweep.failed) == 1 and len(sweep.problems) == 1
    # a rerun of a job leaves two rows: one is kept, the other named
    rerun = json.loads((directory / "rows" / "iid-2-0-fedavg.json").read_text())
    rerun["row_id"] = "iid-2-0-fedavg-rerun"
    (directory / "rows" / "rerun.json").write_text(json.dumps(rerun))
    sweep = load_sweep(directory)
    assert len(sweep.rows) == 11
    assert "iid-2-0-fedavg: the same job as iid-2-0-fedavg-rerun, left out" in sweep.problems
    with pytest.raises(ValueError, match="landscape_grid must be an integer >= 2"):
        write_report(directory, options=DiagnosticsOptions(landscape_grid=1))
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**30) == "3.0 GiB" and human_bytes(None) == "–"
    assert format_stat(Stat.of([1.0])) == "1.00 ± – (n=1)"
    assert format_stat(Stat.of([]), failed=2) == "failed (n=0, 2 failed)"
    assert Stat.of([1.0, None, 3.0]) == Stat(2.0, math.sqrt(2.0), 2)


def test_a_fused_model_of_another_size_says_its_size():
    same = _row("a", "sharded", 2, 0, "kf-linear", fused_parameters=1000, site_parameters=1000)
    wide = _row("b", "sharded", 2, 0, "kf-linear", fused_parameters=2940, site_parameters=1000)
    wide["label"] = "kf-linear widths(2x)"
    summary = summarize([same, wide])
    md = "\n".join(format_results_markdown(summary))
    assert "| kf-linear widths(2x) | conductance | fusion | 1.50 ± – s · 2.94× a site's" in md
    assert "| kf-linear | conductance | fusion | 1.50 ± – s · 3.9 KiB |" in md
    sizes = {r["label"]: r["fused_size_vs_site_mean"] for r in summary_records(summary)}
    assert sizes["kf-linear widths(2x)"] == pytest.approx(2.94)
    assert sizes["kf-linear"] == pytest.approx(1.0)
