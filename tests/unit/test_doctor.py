"""``fedfuse doctor`` (issue 21): versions, device, data, Flower's state and Ray, with a one-line
reason per problem; a state.db another Flower version migrated is one."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fedfuse.cli.main import main
from fedfuse.federation.flower_state import flwr_version, state_revisions


def state_db(flwr_home: Path, revision: str) -> Path:
    """A local SuperLink state.db under ``flwr_home`` stamped with alembic ``revision``."""
    path = flwr_home / "local-superlink" / "state.db"
    path.parent.mkdir(parents=True)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        db.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path / "flwr-home"


def test_a_healthy_setup_exits_0_and_names_what_a_run_uses(home, capsys):
    assert main(["doctor"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    for name in ("python", "torch", "flwr", "captum", "pot", "fedfuse", "device", "ray"):
        assert any(line.split()[0] == name for line in out.splitlines()), name
    assert f"{home} ($FLWR_HOME" in out and "not created yet" in out
    assert "fashion-mnist" in out


def test_a_state_db_of_the_installed_flower_is_fine(home, capsys):
    assert "8e65d8ae60b0" in state_revisions()  # Flower's alembic baseline
    state_db(home, "8e65d8ae60b0")
    assert main(["doctor"]) == 0
    assert f"revision 8e65d8ae60b0 (known to flwr {flwr_version()})" in capsys.readouterr().out


def test_a_foreign_state_db_is_one_problem_line_naming_file_revision_and_version(home, capsys):
    assert "5e1f0a2b3c4d" not in state_revisions()  # a revision of another Flower version
    path = state_db(home, "5e1f0a2b3c4d")
    assert main(["doctor"]) == 1
    problems = capsys.readouterr().err.splitlines()
    assert len(problems) == 1, problems
    assert str(path) in problems[0] and "'5e1f0a2b3c4d'" in problems[0]
    assert f"flwr {flwr_version()}" in problems[0] and "FLWR_HOME" in problems[0]


def test_a_file_that_is_no_database_is_a_problem(home, capsys):
    path = home / "local-superlink" / "state.db"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a database, just bytes" * 100)
    assert main(["doctor"]) == 1
    assert f"{path} is not a readable SQLite database" in capsys.readouterr().err


def test_an_unreachable_ray_address_is_a_problem(home, monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert main(["doctor"]) == 1
    assert "$RAY_ADDRESS=127.0.0.1:1 is not reachable" in capsys.readouterr().err


def test_medmnist_sets_are_found_where_the_loader_reads_them(home, tmp_path, monkeypatch, capsys):
    pytest.importorskip("medmnist")
    monkeypatch.setenv("FEDFUSE_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("FEDFUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "data" / "medmnist").mkdir(parents=True)
    (tmp_path / "data" / "medmnist" / "bloodmnist.npz").write_bytes(b"")
    main(["doctor"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("medmnist"))
    assert f"bloodmnist: {tmp_path / 'data' / 'medmnist' / 'bloodmnist.npz'}" in line
    assert "1 of " in line
    assert f"{tmp_path / 'cache'} ($FEDFUSE_CACHE" in out
