"""The compression benchmark end to end on a tiny setting: a ResNet-34-style teacher compressed
into a ResNet-18-style student by KF Gradient and by KD, rows written, reruns resumed."""

import json

import pytest

from fedfuse.experiments import compression
from fedfuse.io.checkpoint import load_checkpoint

TINY = [
    "--dataset", "digits", "--width-multiplier", "0.0625", "--train-samples", "240",
    "--epochs", "1", "--fusion-samples", "48", "--fusion-epochs", "1", "--device", "cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression")
    compression.main([*TINY, "--seeds", "0", "--out", str(out)])
    return out


def test_rows_for_teacher_reference_kf_and_kd(run):
    rows = json.loads((run / "seed-0.json").read_text())
    models = [row["model"] for row in rows]
    assert models == [
        "ResNet-34 (teacher)",
        "ResNet-18 trained on the fusion classes",
        "ResNet-18: KF Gradient, uniform scores",
        "ResNet-18: Knowledge distillation",
        "ResNet-18: KF Gradient, conductance",
    ]
    assert all(0.0 <= row["accuracy"] <= 1.0 for row in rows)
    assert all(row["fusion_seconds"] > 0 for row in rows[2:])
    assert len(rows[0]["fusion_classes"]) == 3 and rows[0]["fusion_samples"] == 48


def test_teacher_and_reference_are_kept_with_their_depths(run):
    teacher = load_checkpoint(run / "teacher-0.safetensors").model
    student = load_checkpoint(run / "own-classes-0.safetensors").model
    assert teacher.spec.options["blocks"] == [3, 4, 6, 3]
    assert student.spec.options["blocks"] == [2, 2, 2, 2]
    assert len(teacher.levels) == 1 + 16 + 1  # stem, one level per block, head
    assert len(student.levels) == 1 + 8 + 1


def test_a_rerun_resumes_from_the_rows_written(run, capsys, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("a finished seed was run again")

    monkeypatch.setattr(compression, "run_seed", no_training)
    compression.main([*TINY, "--seeds", "0", "--out", str(run)])
    table = capsys.readouterr().out
    assert "| ResNet-18: Knowledge distillation |" in table
    assert len(table.splitlines()) == 2 + 5  # header, rule, one line per model


def test_table_gives_mean_and_sample_std_over_seeds():
    rows = [
        {"model": "m", "accuracy": 0.5, "fusion_seconds": 1.0, "peak_rss_gib": 1.0},
        {"model": "m", "accuracy": 0.7, "fusion_seconds": 3.0, "peak_rss_gib": 2.0},
    ]
    assert compression.table(rows).splitlines()[-1] == "| m | 60.00 ± 14.14 | 2 | 2.0 | 2.00 |"
