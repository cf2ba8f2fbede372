"""``fedfuse simulate`` and Flower's state (issue 21): its own FLWR_HOME per flwr version unless
FLWR_HOME is set, a foreign state.db refused in one line before Flower starts, and a Flower
failure's cause in at most 5 lines."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fedfuse.cli.main import main
from fedfuse.federation.flower_state import failure_reason, flwr_version, simulation_flwr_home
from tests.helpers import flower_test_env, patience
from tests.unit.test_doctor import state_db

# what `flwr run` printed when its local SuperLink could not start (Flower 1.41, 80 columns)
FLWR_RUN_OUTPUT = """
Flower configuration not found. Created default configuration at /tmp/h/config.toml

Starting local SuperLink on 127.0.0.1:39091...
╭─ Error ───────────────╮
│ Failed to start local SuperLink: `flower-superlink` exited with code 1. See  │
│ logs at /tmp/h/local-superlink/superlink.log.                               │
╰────────────────────╯
"""
# the end of what `flower-superlink` printed on that state.db (its log file held no reason)
SUPERLINK_OUTPUT = """\
WARNING flwr 2026-11-26 02:07:20,901 | flower_superlink.py:402 | SuperNode authentication is \
disabled. The SuperLink will accept connections from any SuperNode.
INFO flwr 2026-11-26 02:07:20,901 | flower_superlink.py:472 | Starting Flower SuperLink
Traceback (most recent call last):
  File "/venv/.../alembic/script/base.py", line 239, in _catch_revision_errors
    raise util.CommandError(resolution) from re
alembic.util.exc.CommandError: Can't locate revision identified by 'd9bd9d502cf9'
"""
# what `flower-superlink` printed on a pre-Alembic state.db of another schema (Flower 1.41)
EXIT_CODE_OUTPUT = """\
\x1b[92mINFO \x1b[0m:      Starting Flower SuperLink
\x1b[91mERROR \x1b[0m:     Exit Code: 105
Detected a pre-Alembic Flower state database, but its schema does not match the baseline \
migration (revision 8e65d8ae60b0).
The database schema does not match the expected schema for this version of SuperLink.

For more information, visit: <https://flower.ai/docs/framework/1.41/en/ref-exit-codes/105.html>
"""
# a SuperLink log where the ServerApp process failed
SUPERLINK_LOG = """\
INFO flwr 2026-11-26 02:10:01,100 | flower_superlink.py:472 | Starting Flower SuperLink
INFO flwr 2026-11-26 02:10:02,200 | run_simulation.py:88 | Starting simulation
ERROR flwr 2026-11-26 02:10:09,300 | exec_api.py:120 | ServerApp process exited with code 1
WARNING flwr 2026-11-26 02:10:09,301 | linkstate.py:501 | Run 123 has no result
ERROR flwr 2026-11-26 02:10:09,302 | exec_api.py:120 | ServerApp process exited with code 1
CRITICAL flwr 2026-11-26 02:10:09,400 | ray_backend.py:77 | Ray could not start: out of memory
"""


@pytest.mark.parametrize(
    ("output", "reason"),
    [
        (
            FLWR_RUN_OUTPUT,
            "Error: Failed to start local SuperLink: `flower-superlink` exited with code 1. See "
            "logs at /tmp/h/local-superlink/superlink.log.",
        ),
        (
            SUPERLINK_OUTPUT,
            "alembic.util.exc.CommandError: Can't locate revision identified by 'd9bd9d502cf9'",
        ),
        (
            EXIT_CODE_OUTPUT,
            "Exit Code: 105: Detected a pre-Alembic Flower state database, but its schema does "
            "not match the baseline migration (revision 8e65d8ae60b0).",
        ),
    ],
    ids=["boxed-error-is-one-line", "traceback-gives-its-last-line", "exit-code-explained"],
)
def test_the_reason_is_the_line_that_explains_the_failure(output, reason):
    assert failure_reason(output) == [reason]


def test_a_log_gives_its_errors_messages_once_and_at_most_limit():
    assert failure_reason(SUPERLINK_LOG) == [
        "ServerApp process exited with code 1",
        "Ray could not start: out of memory",
    ]
    assert failure_reason(SUPERLINK_LOG * 3 + FLWR_RUN_OUTPUT, limit=5)[-1].startswith(
        "Error: Failed to start local SuperLink"
    )
    assert len(failure_reason("\n".join(f"ERROR : failure {i}" for i in range(20)))) == 5
    assert failure_reason("INFO : all good\nWARNING : slow\n") == []


def test_flwr_home_is_fedfuses_own_per_flwr_version_unless_set(tmp_path):
    home, chosen = simulation_flwr_home({"XDG_STATE_HOME": str(tmp_path)})
    assert (home, chosen) == (tmp_path / "fedfuse" / f"flwr-{flwr_version()}", False)
    home, chosen = simulation_flwr_home({"FLWR_HOME": str(tmp_path / "mine")})
    assert (home, chosen) == (tmp_path / "mine", True)
    assert simulation_flwr_home({})[0] == (
        Path.home() / ".local" / "state" / "fedfuse" / f"flwr-{flwr_version()}"
    )


@pytest.mark.parametrize("where", ["FLWR_HOME", "XDG_STATE_HOME"])
def test_a_foreign_state_db_stops_simulate_in_one_line_before_flower_starts(
    where, tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("FLWR_HOME", raising=False)
    monkeypatch.setenv(where, str(tmp_path / "state"))
    home = simulation_flwr_home()[0]
    path = state_db(home, "5e1f0a2b3c4d")
    code = main(["simulate", "--output-dir", str(tmp_path / "out")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("fedfuse simulate: error: ")
    assert str(path) in err[0] and "'5e1f0a2b3c4d'" in err[0]
    assert f"flwr {flwr_version()}" in err[0]
    assert not (home / "local-superlink" / "superlink.log").exists()  # no SuperLink started
    assert not (home / "config.toml").exists()  # nor `flwr run`


@pytest.mark.e2e
def test_when_the_superlink_cannot_start_simulate_prints_flowers_reason(tmp_path):
    """A real Flower failure: a pre-Alembic state.db of another schema passes fedfuse's check,
    Flower's local SuperLink refuses it, and simulate prints why in at most 5 lines."""
    env, _ = flower_test_env(tmp_path)
    database = Path(env["FLWR_HOME"]) / "local-superlink" / "state.db"
    database.parent.mkdir(parents=True)
    with sqlite3.connect(database) as db:
        db.execute("CREATE TABLE run (x INTEGER)")
    command = [sys.executable, "-m", "fedfuse.cli.main", "simulate"]
    completed = subprocess.run(
        [*command, "--output-dir", str(tmp_path / "out"), "--timeout", str(round(patience(120)))],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(180),
    )
    err = [line for line in completed.stderr.splitlines() if "fedfuse.cli" not in line]
    assert completed.returncode == 1 and 2 <= len(err) <= 5, completed.stderr
    assert err[0].startswith("fedfuse simulate: FAILED: no result file")
    assert "Failed to start local SuperLink" in completed.stderr
    assert "Exit Code: 105: Detected a pre-Alembic Flower state database" in completed.stderr


def test_every_flower_command_of_fedfuse_gets_the_checked_home(tmp_path, monkeypatch):
    """``flower_environment`` (simulate, run-app) sets FLWR_HOME and refuses a foreign state.db."""
    from fedfuse.federation.flower_state import StateDatabaseError
    from fedfuse.federation.simulation import flower_environment

    monkeypatch.delenv("FLWR_HOME", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    env, _ = flower_environment()
    assert env["FLWR_HOME"] == str(tmp_path / "state" / "fedfuse" / f"flwr-{flwr_version()}")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "mine"))
    state_db(tmp_path / "mine", "5e1f0a2b3c4d")
    with pytest.raises(StateDatabaseError, match="written by another Flower version"):
        flower_environment()


def test_a_run_whose_serverapp_died_reads_failed_with_flowers_reason(tmp_path):
    """Under `ulimit -v` the ServerApp died below Python and its results.json said `running`
    for good; simulate now marks it failed, with what Flower logged, in the file itself."""
    from fedfuse.cli.simulate import settle_unfinished

    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "latest").symlink_to(run)
    results = tmp_path / "latest" / "results.json"
    results.write_text(json.dumps({"status": "running", "run_id": 7}))
    reasons = failure_reason("ERROR :      Exit Code: 137\nKilled by the kernel\n")
    report = settle_unfinished(results, json.loads(results.read_text()), 1, reasons)
    assert report["status"] == "failed" and report["run_id"] == 7
    assert "ServerApp ended without finishing the run (flwr exit 1)" in report["error"]
    assert "Exit Code: 137" in report["error"]
    assert json.loads((run / "results.json").read_text()) == report  # the file says so too
    assert (tmp_path / "latest").is_symlink()


def test_a_local_superlink_that_missed_flower_s_start_limit_is_started_once_more(
    tmp_path, monkeypatch
):
    """Flower gives its local SuperLink 15 s to start; on a loaded machine `flwr run` can fail
    so before any run exists. fedfuse runs it once more (and never a third time)."""
    from fedfuse.federation import simulation

    calls = tmp_path / "calls"
    fake = tmp_path / "flwr"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$1" >> {calls}\n'
        'if [ "$1" = list ]; then\n'
        '  echo \'{"runs": [{"status": "finished:completed"}]}\'; exit 0; fi\n'
        f'if [ "$(grep -c run {calls})" = 1 ]; then\n'
        '  echo "Error: Failed to start local SuperLink within 15s. See logs at x."; exit 1; fi\n'
        'echo "Successfully started run 42"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setattr(simulation, "flower_environment", lambda: (dict(os.environ), str(fake)))
    run = simulation.run_flower_app(tmp_path, echo=False, timeout=60)
    assert run.ok and run.run_id == "42"
    assert calls.read_text().split() == ["run", "run", "list"]
    calls.write_text("run\n")  # a second start-up miss is reported, not retried again
    fake.write_text(fake.read_text().replace("= 1 ]", "-ge 1 ]"))
    run = simulation.run_flower_app(tmp_path, echo=False, timeout=60)
    assert not run.ok and run.returncode == 1 and "within 15s" in run.output
