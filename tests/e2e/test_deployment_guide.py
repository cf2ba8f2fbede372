"""docs/deployment.md, run as written: every ``bash`` block, in order, in one shell.

Only the base directory is changed (``export FEDFUSE_BASE=/srv/fedfuse`` points at a temporary
folder). A block whose first line is ``# in a terminal of its own`` is started in the background,
as a reader starts it in a second terminal, and the next block waits until its log shows the
line the guide says it prints when ready. Everything runs on 127.0.0.1: TLS, SuperNode
authentication, two SuperNodes, the run, the status check and a prediction. Every output the
guide shows (a block without a language after a command) is compared with what that command
printed: the accuracy tables within their tolerances, the predictions' probabilities within
0.05, all else line by line but for values that differ from run to run (tests/shown_outputs.py).
A guide that drifts from the code fails here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedfuse.io.checkpoint import load_checkpoint
from tests.helpers import accuracy_tables, assert_same_table, descendants, patience
from tests.shown_outputs import assert_shows, fenced_blocks

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "deployment.md"
BASE_LINE = "export FEDFUSE_BASE=/srv/fedfuse"
BACKGROUND = "# in a terminal of its own"
READY = re.compile(r'ready when it logs "([^"]+)"')
MARKER = re.compile(r">>> guide block (\d+) at \d+ s$")
#: the ports the guide's processes listen on
GUIDE_PORTS = (8000, 9094, 9095)
#: seconds the whole guide may take (its first run takes about a minute, the secure run about
#: two: a SuperNode starts its ClientApp anew for each of SecAgg+'s stages)
GUIDE_TIMEOUT = 1500


def guide_blocks(text: str) -> list[str]:
    """The guide's ``bash`` blocks, in order."""
    return [body for lang, body in fenced_blocks(text) if lang == "bash"]


def guide_outputs(text: str) -> list[tuple[int, str]]:
    """The outputs the guide shows: each block without a language, with the index of the
    ``bash`` block before it (the one that printed it)."""
    outputs, bash = [], -1
    for lang, body in fenced_blocks(text):
        if lang == "bash":
            bash += 1
        elif not lang:
            assert bash >= 0, f"an output block before any command: {body[:80]}"
            outputs.append((bash, body))
    return outputs


def printed_by_block(stdout: str) -> dict[int, str]:
    """What each of the guide's blocks printed, from the script's markers (:func:`guide_script`)."""
    printed, index = {}, None
    for line in stdout.splitlines(keepends=True):
        marker = MARKER.match(line)
        if marker:
            index = int(marker[1])
            printed[index] = ""
        elif index is not None:
            printed[index] += line
    return printed


def prediction_rows(text: str) -> dict[str, tuple[str, float]]:
    """``fedfuse predict``'s rows in ``text``: image -> (class, probability)."""
    rows = re.findall(r"^(\S+\.png),([^,\s]+),([01]\.\d+)$", text, flags=re.MULTILINE)
    return {image: (label, float(p)) for image, label, p in rows}


def guide_script(blocks: list[str], base: Path, logs: Path) -> str:
    """One bash script: the blocks in order, the base directory substituted, background blocks
    started in the background and waited for."""
    lines = [
        "set -euo pipefail",
        "exec 2>&1  # one stream: each block's output follows its marker line",
        "wait_for_log() {  # file, line to wait for, seconds",
        "  local deadline=$((SECONDS + $3))",
        '  until grep -qF -- "$2" "$1" 2>/dev/null; do',
        '    if ((SECONDS > deadline)); then echo "never logged: $2 ($1)" >&2; return 1; fi',
        "    sleep 0.5",
        "  done",
        "}",
    ]
    for index, block in enumerate(blocks):
        block = block.replace(BASE_LINE, f"export FEDFUSE_BASE={shlex.quote(str(base))}")
        lines.append(f'echo ">>> guide block {index} at $SECONDS s"')
        first = block.splitlines()[0] if block else ""
        if first.startswith(BACKGROUND):
            ready = READY.search(first)
            assert ready, f"block {index} runs in the background but says no ready line: {first}"
            log = logs / f"background-{index}.log"
            lines += [
                f"(\n{block}\n) > {shlex.quote(str(log))} 2>&1 &",
                f"echo $! >> {shlex.quote(str(logs / 'pids'))}",
                f"wait_for_log {shlex.quote(str(log))} {shlex.quote(ready[1])} 180",
            ]
        else:
            lines.append(block)
    return "\n".join(lines) + "\n"


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def _stop(pids: list[int]) -> None:
    """SIGTERM every background process and all it spawned; SIGKILL what is left."""
    everything = {p for pid in pids for p in [pid, *descendants(pid)]}
    for pid in everything:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in everything):
        time.sleep(0.2)
    for pid in everything:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_the_guide_blocks_are_found_and_only_the_base_is_substituted():
    text = GUIDE.read_text()
    assert text.count(BASE_LINE) == 1
    blocks = guide_blocks(text)
    background = [b for b in blocks if b.startswith(BACKGROUND)]
    assert len(background) == 3  # the SuperLink and two SuperNodes
    assert any(b.startswith("flwr run . hospitals") for b in blocks)
    assert not any("/srv/" in b for b in blocks if BASE_LINE not in b)  # one base everywhere
    assert not any(re.search(r"(^|\s)cd\s", b) for b in blocks)  # one working directory


def test_every_output_the_guide_shows_follows_the_command_that_prints_it():
    outputs = guide_outputs(GUIDE.read_text())
    blocks = guide_blocks(GUIDE.read_text())
    printed_by = [blocks[index].split()[:2] for index, _ in outputs]
    assert printed_by == [
        ["fedfuse", "certs"],
        ["fedfuse", "site-data"],
        ["fedfuse", "keys"],
        ["ssh-keygen", "-lf"],
        ["flwr", "supernode"],
        ["fedfuse", "site-data"],
        ["flwr", "run"],
        ["fedfuse", "status"],
        ["fedfuse", "predict"],
        ["flwr", "run"],
        ["python", "-c"],
    ]
    assert len([shown for _, shown in outputs if accuracy_tables(shown)]) == 2
    assert len(prediction_rows(outputs[8][1])) == 5


def test_the_deployment_guide_runs_as_written(tmp_path):
    busy = [port for port in GUIDE_PORTS if _listening(port)]
    if busy:
        pytest.fail(f"the guide's ports {busy} are in use on this machine; free them to run it")
    base, logs = tmp_path / "srv", tmp_path / "logs"
    logs.mkdir()
    script = guide_script(guide_blocks(GUIDE.read_text()), base, logs)
    (logs / "guide.sh").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if Path(sys.executable).parent != Path(p)
    )
    started = time.monotonic()
    try:
        completed = subprocess.run(
            ["bash", str(logs / "guide.sh")],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=patience(GUIDE_TIMEOUT),
        )
    except subprocess.TimeoutExpired as error:
        completed = None
        output = f"timed out after {GUIDE_TIMEOUT} s\n{error.stdout}\n{error.stderr}"
    finally:
        pids_file = logs / "pids"
        pids = [int(p) for p in pids_file.read_text().split()] if pids_file.exists() else []
        _stop(pids)
    seconds = time.monotonic() - started
    if completed is not None:
        output = f"{completed.stdout[-6000:]}\n{completed.stderr[-6000:]}"
        (logs / "guide-stdout.txt").write_text(completed.stdout)  # for the guide's examples

    def context() -> str:
        tails = [
            f"----- {log.name} -----\n" + "\n".join(log.read_text().splitlines()[-30:])
            for log in sorted(logs.glob("background-*.log"))
        ]
        return f"\n{output}\n" + "\n".join(tails)

    assert completed is not None and completed.returncode == 0, context()
    print(f"the deployment guide ran in {seconds:.0f} s")

    # the sites checked their data against the contract (a real query round) before training
    assert "checking 2 sites' data against the run's data contract" in completed.stdout
    assert "could not check its data" not in completed.stdout, context()

    # the status check passed (it exits non-zero otherwise); what it read says the rest
    report = json.loads((base / "server" / "outputs" / "latest" / "results.json").read_text())
    assert report["status"] == "ok", context()
    assert [(s["site"], s["status"]) for s in report["sites"]] == [
        ("site-0", "uploaded"),
        ("site-1", "uploaded"),
    ]
    assert all(isinstance(s["node_id"], int) for s in report["sites"])
    held = [{k for k, n in enumerate(c["class_counts"]) if n} for c in report["clients"]]
    assert sorted(held, key=min) == [set(range(5)), set(range(5, 10))]
    assert report["accuracy"]["fused"]["kf-linear"]["accuracy"] > 0.5, report["accuracy"]

    # the fused model stands alone, and `fedfuse predict` used its class names
    fused = load_checkpoint(report["fusions"]["kf-linear"]["checkpoint"]).metadata
    assert fused["class_names"][9] == "boot" and fused["normalisation"]["mean"] == [0.286]
    assert [s["name"] for s in fused["sites"]] == ["site-0", "site-1"]
    assert fused["data_files"]["fusion-data"]["path"].endswith("server/data/fusion.npz")
    assert "image,class,probability" in completed.stdout

    # the secure run: regmean from Gram sums the server unmasked with SecAgg+, each SuperNode
    # starting a ClientApp per stage (kf-sites' secure rounds, one per level, run through the
    # same SecAgg+ workflow in tests/e2e/test_e2e_simulation.py)
    secure = json.loads(
        (base / "server" / "outputs-secure" / "latest" / "results.json").read_text()
    )
    assert secure["status"] == "ok", secure
    assert secure["settings"]["secure-aggregation"] is True
    assert secure["fusions"]["regmean"]["status"] == "ok"
    assert secure["fusions"]["regmean"]["details"]["sites"] == [0, 1]
    assert secure["accuracy"]["fused"]["regmean"]["accuracy"] > 0.5, secure["accuracy"]
    assert all("grams" not in c for c in secure["clients"])  # nothing per site was stored
    assert "secure regmean round: the sum of 2 of 2 sites" in completed.stdout
    predictions = completed.stdout.split("image,class,probability", 1)[1].split()[:5]
    assert all(row.split(",")[1] in fused["class_names"] for row in predictions), predictions

    assert_outputs_shown(completed.stdout, base)


def assert_outputs_shown(stdout: str, base: Path) -> None:
    """What the guide shows each command print is what the guide's run printed (``stdout``,
    with its base folder ``base``): the two runs' tables with their tolerances, the
    predictions' classes and probabilities within 0.05, every other line as printed (values
    that differ from run to run aside: tests/shown_outputs.py); and section 11's traffic."""
    by_block = printed_by_block(stdout)
    blocks = guide_blocks(GUIDE.read_text())
    (listed,) = [by_block[i] for i, b in enumerate(blocks) if b.startswith("flwr list hospitals")]
    (run,) = json.loads(listed[listed.index("{") :])["runs"]  # section 10's run
    assert run["status"] == "finished:completed"
    assert abs(run["network-traffic"]["inbound-bytes"] - 7.5e6) < 0.05 * 7.5e6, run
    for index, shown in guide_outputs(GUIDE.read_text()):
        printed = by_block[index]
        if accuracy_tables(shown):
            (printed_table,), (shown_table,) = accuracy_tables(printed), accuracy_tables(shown)
            assert_same_table(printed_table, shown_table)
            continue
        assert_shows(printed, shown, [(str(base), "/srv/fedfuse")])
        if prediction_rows(shown):
            got, want = prediction_rows(printed), prediction_rows(shown)
            assert {k: c for k, (c, _) in got.items()} == {k: c for k, (c, _) in want.items()}
            assert all(abs(got[k][1] - p) <= 0.05 for k, (_, p) in want.items()), (got, want)
