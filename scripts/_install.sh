#!/usr/bin/env bash
# Install opsdk and what its checks need into ./.venv. Idempotent: once done, a re-run only
# checks. Sourced by scripts/verify-all.sh and scripts/test.sh; sets $PY.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BASE_PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
apt_install() {
  if [ "$(id -u)" != 0 ]; then
    echo "opsdk: missing system packages; run as root: apt-get install -y $*" >&2
    exit 1
  fi
  [ -n "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v lock)" ] || apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" || {
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"; }
}
# Debian's python3 ships venv/ensurepip separately.
"$BASE_PY" -c "import ensurepip, venv" 2>/dev/null || apt_install python3-venv python3-pip
# TVM links exported libraries with the host C++ compiler; the C++ deploy example uses make.
{ command -v g++ && command -v make; } >/dev/null || apt_install g++ make
if [ ! -x .venv/bin/python ]; then
  "$BASE_PY" -m venv .venv
fi
PY=$(pwd)/.venv/bin/python
stamp=.venv/.opsdk-installed
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$PY" -c "import opsdk, pytest, ruff" 2>/dev/null; then
  "$PY" -m pip install --disable-pip-version-check -q --upgrade pip
  "$PY" -m pip install --disable-pip-version-check -q -e ".[dev,torch,onnx,bench,zoo,farm]" -c <(echo torch==2.13.0)
  echo "$want" > "$stamp"
fi
export PATH="$(pwd)/.venv/bin:$PATH"
# The aarch64 cross compiler, qemu-user and the cached aarch64 Python with TVM's runtime.
"$PY" -m opsdk setup arm
