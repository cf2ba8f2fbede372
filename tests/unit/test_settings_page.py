"""docs/settings.md: current with the stored rows, and its choice of leader (issue 52)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from fedfuse.experiments import settings_page
from fedfuse.experiments.settings_page import PAGE, load_tables, settings_markdown

#: the columns of a fedfuse report CSV that the page reads
COLUMNS = (
    *("experiment", "dataset", "model", "partition", "scores", "label", "kind", "stage"),
    *("runner", "sites", "n", "failed", "seeds", "accuracy_pct_mean", "accuracy_pct_std"),
    *("upload_bytes_per_site_mean", "statistics_rounds", "round_upload_bytes_per_site_max_mean"),
    "fused_size_vs_site_mean",
)


def _row(label: str, kind: str, accuracy: float | None, **extra: object) -> dict[str, object]:
    row = {
        "experiment": "fmnist-mlp",
        "dataset": "fashion-mnist",
        "model": "mlp",
        "partition": "sharded",
        "sites": 2,
        "label": label,
        "kind": kind,
        "stage": "" if kind == "reference" else "zero-shot",
        "n": 0 if accuracy is None else 2,
        "failed": 2 if accuracy is None else 0,
        "seeds": "" if accuracy is None else "0 1",
        "accuracy_pct_mean": "" if accuracy is None else accuracy,
        "accuracy_pct_std": "" if accuracy is None else 0.5,
        "upload_bytes_per_site_mean": "" if kind == "reference" else 2 * 1024**2,
        "statistics_rounds": 0,
    }
    return {**row, **extra}


def _write_csv(directory: Path, rows: list[dict[str, object]]) -> None:
    directory.mkdir(parents=True)
    with (directory / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)


def test_the_committed_page_is_the_one_the_stored_rows_give() -> None:
    assert PAGE.read_text() == settings_markdown(), (
        "docs/settings.md is stale: run python -m fedfuse.experiments.settings_page"
    )


def test_the_leader_is_the_best_single_model_that_succeeded(tmp_path: Path) -> None:
    """The ensemble (higher), a failed method and a fine-tuned row (higher still) never lead."""
    _write_csv(
        tmp_path / "sweep",
        [
            _row("base models (mean)", "reference", 40.0),
            _row("ensemble", "reference", 90.0),
            _row("kf-linear", "fusion", 70.0),
            _row("regmean", "fusion", None),
            _row("kd", "trains on the fusion set", 60.0),
            _row("fedavg", "fusion", 50.0),
            _row("kf-linear +ft(fusion-set,10ep)", "fusion", 95.0, stage="finetuned"),
        ],
    )
    (table,) = load_tables(tmp_path)
    leader = settings_page.leading(table.cells[("sharded", 2)])
    assert leader is not None and leader.label == "kf-linear"

    page = settings_markdown(tmp_path)
    (line,) = [x for x in page.splitlines() if x.startswith("| sharded | 2 |")]
    cells = [c.strip() for c in line.strip("|").split(" | ")]
    assert cells[2] == "`kf-linear`"
    assert cells[3] == "70.00 ± 0.50 (n=2)"
    assert cells[5] == "-20.00"  # below the ensemble, said so
    assert cells[6:8] == ["", ""]  # auto not run here
    assert cells[8] == "40.00 ± 0.50 (n=2)"
    assert cells[9].startswith("weights, the sites' class counts, the sites' importance scores")
    assert "(2.0 MiB per site)" in cells[9] and "server side: a fusion set" in cells[9]
    assert cells[10] == (
        "`fedfuse compare -m experiment=fmnist-mlp partition=sharded sites=2 seed=0,1 "
        "method=kf-linear`"
    )
    assert "| dirichlet | 8 | no stored rows yet |" in page  # declared by the preset, not run
    assert "The leader is below the ensemble in 1 of 1 settings" in page
    assert "`lenet5`: no stored rows yet" in page


def test_auto_is_shown_beside_the_leader_and_never_leads(tmp_path: Path) -> None:
    """``auto`` picks one of the listed methods, so it is its own column, measured against the
    leader and the ensemble (issue 52's goal: within a point, above the ensemble)."""
    _write_csv(
        tmp_path / "sweep",
        [
            _row("ensemble", "reference", 60.0),
            _row("kf-sites", "fusion", 86.0),
            _row("auto", "fusion", 86.5),
            _row("ensemble", "reference", 80.0, sites=4),
            _row("kf-linear", "fusion", 82.0, sites=4),
            _row("auto", "fusion", 79.0, sites=4),
            _row("ensemble", "reference", 50.0, sites=8),
            _row("kf-linear", "fusion", 70.0, sites=8),  # auto not run here
        ],
    )
    page = settings_markdown(tmp_path)
    (two,) = [x for x in page.splitlines() if x.startswith("| sharded | 2 |")]
    (four,) = [x for x in page.splitlines() if x.startswith("| sharded | 4 |")]
    cells = [c.strip() for c in two.strip("|").split(" | ")]
    assert cells[2] == "`kf-sites`"  # auto scored higher, yet the leader is a method
    assert cells[6:8] == ["86.50 ± 0.50 (n=2)", "+0.50"]
    assert [c.strip() for c in four.strip("|").split(" | ")][6:8] == ["79.00 ± 0.50 (n=2)", "-3.00"]
    assert (
        "`auto` was run in 2 of these settings: within 1 point of the leader in 1; at or "
        "above the ensemble in 1 of the 2 where the leader is."
    ) in page
    assert not [x for x in page.splitlines() if x.startswith("Run in some") and "`auto`" in x]


def test_a_plain_models_run_leads_with_the_users_model_alone(tmp_path: Path) -> None:
    """``own ...`` rows (fedfuse's architecture) and the references are not candidates."""
    (tmp_path / "user-models").mkdir()
    rows = [
        {
            "best site": {"accuracy": 0.5},
            "ensemble": {"accuracy": 0.9},
            "kf-sites": {"accuracy": 0.8, "seconds": 1.0},
            "fedavg": {"accuracy": 0.1, "seconds": 0.1},
            "own kf-sites": {"accuracy": 0.85, "seconds": 1.0},
        }
    ]
    args = {"sites": 4, "partitioner": "dirichlet", "seeds": [3], "epochs": 1}
    args |= {"dataset": "fashion-mnist", "model": "vit", "own": True, "methods": None}
    path = tmp_path / "user-models" / "vit.json"
    path.write_text(json.dumps({"args": args, "rows": rows}))

    page = settings_markdown(tmp_path)
    (line,) = [x for x in page.splitlines() if x.startswith("| dirichlet | 4 |")]
    assert "`kf-sites`" in line and "80.00 ± – (n=1)" in line and "| -10.00 |" in line
    assert "the sites themselves for statistics rounds" in line
    assert (
        "`python -m fedfuse.experiments.plain_models --sites 4 --partitioner dirichlet --seeds 3 "
        "--epochs 1 --dataset fashion-mnist --model vit --methods kf-sites`"
    ) in line


def test_a_plain_models_method_that_trains_on_the_fusion_set_says_so(tmp_path: Path) -> None:
    """As in compare's rows, ``linear-probe`` leading a plain-model cell is marked as training."""
    (tmp_path / "user-models").mkdir()
    rows = [{"ensemble": {"accuracy": 0.9}, "linear-probe": {"accuracy": 0.8, "seconds": 1.0}}]
    args = {"sites": 2, "partitioner": "sharded", "seeds": [0], "epochs": 1}
    args |= {"dataset": "fashion-mnist", "model": "vit", "own": False, "methods": None}
    (tmp_path / "user-models" / "vit.json").write_text(json.dumps({"args": args, "rows": rows}))

    page = settings_markdown(tmp_path)
    (line,) = [x for x in page.splitlines() if x.startswith("| sharded | 2 |")]
    assert "`linear-probe` (trains on the fusion set)" in line


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "settings.md"
    stale.write_text("# old\n")
    assert settings_page.main(["--check", "--output", str(stale)]) == 1
    assert settings_page.main(["--output", str(stale)]) == 0
    assert settings_page.main(["--check", "--output", str(stale)]) == 0
