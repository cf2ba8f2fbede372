#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian machine: the Fashion-MNIST data package, a virtual
# environment in .venv, and fedfuse (editable, with test tools) pinned by constraints.txt.
set -euo pipefail
cd "$(dirname "$0")"

FMNIST=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
if [ ! -e "$FMNIST" ] && [ -z "${FEDFUSE_DATA:-}" ]; then
  echo "setup: installing the Debian package dataset-fashion-mnist" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# What was installed, by the files that decide it: a second run with the same ones skips pip's
# 12-15 s of resolving (the deployment guide runs this script again).
INSTALLED=$(cat pyproject.toml constraints.txt setup.sh | sha256sum | cut -d' ' -f1)
STAMP=.venv/.fedfuse-installed
if [ "$(cat "$STAMP" 2>/dev/null)" != "$INSTALLED" ]; then
  # uv installs the pinned set in about 30 s where pip takes about 120 s (parallel downloads
  # and unpacking). It runs from a temporary folder (the environment gets its own uv as a
  # dependency of flwr); where uv cannot be had or fails, pip installs alone.
  UV_DIR=$(mktemp -d)
  if .venv/bin/python -m pip install -q --disable-pip-version-check --target "$UV_DIR" uv \
    >/dev/null 2>&1 &&
    "$UV_DIR/bin/uv" pip install -q --native-tls --python .venv/bin/python \
      -c constraints.txt -e '.[dev]'; then
    :
  else
    echo "setup: uv unavailable or failed; installing with pip" >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile \
      -c constraints.txt -e '.[dev]'
  fi
  rm -rf "$UV_DIR"
  # Neither compiles byte-code (pip's own compilation runs on one core: 73 s of a 189 s
  # install); compileall on every core, skipping the packages' own test suites, takes 35 s.
  # Byte-code matters on machines that set PYTHONDONTWRITEBYTECODE: without it every process
  # (each ClientApp a SuperNode starts) would compile PyTorch and Ray from source again.
  SITE_PACKAGES=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  .venv/bin/python -m compileall -q -j 0 -x '/(tests|rllib|_vendor)/|/torch/testing/_internal/' \
    "$SITE_PACKAGES" >/dev/null
  echo "$INSTALLED" > "$STAMP"
fi
.venv/bin/python -m compileall -q -j 0 fedfuse strategies clients partitions >/dev/null
