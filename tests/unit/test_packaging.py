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
