"""The summary a newcomer reads after a run: each method's cost to the sites, the best single
model, and warnings that name better methods when a fused model fails."""

from __future__ import annotations

from fedfuse.federation.evaluation import (
    format_accuracy_table,
    format_run_summary,
    method_cost,
    summary_warnings,
)

CLIENTS = [
    {"upload_parts": {"weights": 1000, "scores": 100, "grams": 5000}, "class_counts": [5] * 10},
    {"upload_parts": {"weights": 1000, "scores": 300, "grams": 7000}, "class_counts": [5] * 10},
]


def _evaluation(fused: dict[str, float], base=(0.43, 0.49), ensemble=0.67) -> dict:
    def scores(accuracy):
        return {"accuracy": accuracy, "loss": 1.0}

    return {
        "base": [scores(a) for a in base],
        "ensemble": scores(ensemble),
        "fused": {name: scores(a) for name, a in fused.items()},
        "test_examples": 100,
    }


def test_a_method_pays_only_for_the_upload_parts_it_reads_and_its_rounds():
    assert method_cost((), CLIENTS).upload_bytes == 1000
    assert method_cost({"scores"}, CLIENTS).upload_bytes == 1200
    grams = method_cost({"grams"}, CLIENTS)
    assert grams.upload_bytes == 7000 and grams.rounds == 0 and grams.sends_data_statistics
    rounds = [{"upload_bytes": {"0": 10, "1": 30}}, {"upload_bytes": {"0": 50, "1": 70}}]
    sites = method_cost({"scores", "sites"}, CLIENTS, {"rounds": rounds}, 1.5)
    assert (sites.rounds, sites.round_bytes, sites.seconds) == (2, 60.0, 1.5)
    assert sites.describe() == "1 upload, 1.2 KiB + 2 rounds of <= 60 B"
    assert method_cost((), CLIENTS).describe() == "1 upload, 1000 B"


def test_the_table_marks_the_best_single_model_not_the_ensemble():
    evaluation = _evaluation({"kf-sites": 0.87, "fedavg": 0.55}, ensemble=0.95)
    costs = {"kf-sites": method_cost({"sites"}, CLIENTS), "fedavg": method_cost((), CLIENTS)}
    lines = format_accuracy_table(evaluation, costs, method_cost((), CLIENTS)).splitlines()
    marked = [line for line in lines if "best single model" in line]
    assert len(marked) == 1 and marked[0].startswith("fused: kf-sites")
    assert "docs/privacy.md" in lines[-1] and "kf-sites" in lines[-1]
    assert "fedavg" not in lines[-1]
    # a base model can be the best single model too
    lines = format_accuracy_table(_evaluation({"fedavg": 0.2}), {}).splitlines()
    assert [line for line in lines if "best single" in line][0].startswith("base model 1")
    # without costs the table is the plain one
    assert "best single" not in format_accuracy_table(evaluation)


def test_a_fused_model_at_chance_or_below_every_base_model_is_named_with_better_methods():
    evaluation = _evaluation({"kf-linear": 0.1197, "regmean": 0.79, "fedavg": 0.40})
    warnings = summary_warnings(evaluation, num_classes=10)
    assert len(warnings) == 2
    chance, below = warnings
    assert "kf-linear is at chance (11.97%" in chance
    assert "regmean (79.00% here)" in chance and "kf-sites" in chance
    assert "fedavg is below every base model (40.00% < 43.00%)" in below
    assert summary_warnings(_evaluation({"kf-sites": 0.87}), num_classes=10) == []


def test_the_run_summary_reads_a_results_document():
    report = {
        "clients": CLIENTS,
        "accuracy": _evaluation({"regmean": 0.83, "fedavg": 0.11}),
        "fusions": {
            "regmean": {"status": "ok", "needs": ["grams"], "seconds": 0.2, "details": {}},
            "fedavg": {"status": "ok", "needs": [], "seconds": 0.01, "details": {}},
        },
    }
    text = format_run_summary(report)
    assert "1 upload, 6.8 KiB" in text and "0.20s" in text
    assert text.splitlines()[-1].startswith("warning: fused model fedavg is at chance")


def test_the_summary_says_what_auto_chose_and_why():
    why = "hf-sites had the highest accuracy, 89.00% on the 60000 rows of all 2 sites"
    report = {
        "clients": CLIENTS,
        "accuracy": _evaluation({"auto": 0.87, "fedavg": 0.55}),
        "fusions": {
            "auto": {"status": "ok", "details": {"auto": {"chosen": "hf-sites", "why": why}}},
            "fedavg": {"status": "ok", "details": {}},
        },
    }
    lines = format_run_summary(report).splitlines()
    assert f"auto chose hf-sites: {why}" in lines
    assert sum(line.startswith("auto chose") for line in lines) == 1
