"""The distribution installs one import package, `fedfuse`, with the layers mapped inside it."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_has_only_fedfuse_at_the_top_level(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(REPO),
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("fedfuse-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"fedfuse"}
    for layer in ("strategies", "clients", "partitions"):
        assert f"fedfuse/{layer}/__init__.py" in names
    assert "fedfuse/strategies/server_app.py" in names
    for module in (
        "fedfuse/experiments/compare.py",
        "fedfuse/fusion/methods/matching/otfusion.py",
        "fedfuse/cli/main.py",
    ):
        assert module in names
    assert "fedfuse/configs/compare.yaml" in names
    assert "fedfuse/configs/method/kf-linear.yaml" in names
    assert "fedfuse/configs/experiment/fmnist-mlp.yaml" in names


def test_the_client_app_loads_without_pytorch():
    """A SuperNode starts a ClientApp process per message; the SecAgg+ stages that only
    exchange keys must not pay for PyTorch (the handlers import it with their first message)."""
    probe = (
        "import sys; from fedfuse.clients.client_app import app; "
        "from fedfuse.clients.secure import secure_sums_mod; "
        "print(sorted(m for m in ('torch', 'fedfuse.federation.site') if m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    assert loaded == "[]"
