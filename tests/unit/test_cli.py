import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedfuse.cli.main import main
from fedfuse.io.checkpoint import save_checkpoint
from fedfuse.models import build_model, mlp_spec
from fedfuse.models.importance import uniform_scores


def test_partition_prints_the_class_table_and_plots(tmp_path, capsys):
    plot = tmp_path / "counts.png"
    assert (
        main(
            [
                "partition",
                "--dataset",
                "digits",
                "--partitioner",
                "sharded",
                "--num-clients",
                "3",
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("\n") >= 4 and plot.stat().st_size > 1000


def test_inspect_validates_and_prints_metadata(tmp_path, capsys):
    model = build_model(mlp_spec((1, 4, 4), 3, (8,)), seed=0)
    path = save_checkpoint(
        tmp_path / "m.safetensors",
        model,
        scores=uniform_scores(model),
        metadata={"strategy": "fedavg"},
    )
    assert main(["inspect", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["strategy"] == "fedavg" and summary["scores"] == [0, 2]
    path.write_bytes(b"not a checkpoint")
    assert main(["inspect", str(path)]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


def test_the_command_line_parses_without_pytorch():
    """Every ``fedfuse`` process builds the whole parser; ``status``, ``certs``, ``keys``,
    ``run-app`` and the ``simulate`` parent must not pay ~3 s of CPU for PyTorch to do it."""
    probe = (
        "import contextlib, io, sys\n"
        "from fedfuse.cli.main import build_parser, main\n"
        "build_parser()\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['status', '--help'])\n"
        "heavy = ('torch', 'fedfuse.fusion', 'fedfuse.models', 'fedfuse.data')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.strip()
    assert loaded == "[]"


def test_unknown_partitioner_is_a_usage_error():
    with pytest.raises(SystemExit):
        main(["partition", "--partitioner", "random"])


def test_usage_errors_are_one_line(capsys):
    for argv in (["fuse"], ["simulate", "--num-clients", "x"], ["no-such-command"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ": error: " in err, err


def test_methods_lists_the_registry_with_needs_and_accepted_architectures(capsys):
    import json

    from fedfuse.fusion import FUSION_METHODS

    assert main(["methods", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(FUSION_METHODS)
    assert "statistics rounds" in rows["kf-sites"]["sites send"]
    assert rows["regmean"]["sites send"] == ["sample counts (optional)", "Gram matrices"]
    assert rows["hf-linear"]["models"] == rows["kf-linear"]["models"] == "2 or more"
    assert rows["kf-linear"]["accepts"]["mlp"] == "yes"
    assert rows["kf-linear"]["accepts"]["resnet"] == "yes"
    assert rows["kf-linear"]["accepts"]["vit"] == "yes"
    assert rows["kf-linear"]["accepts"]["plain nn.Module"] == "yes"
    assert rows["fedma"]["accepts"]["plain nn.Module"].startswith("no: ")
    assert main(["methods"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("method ")
