#!/usr/bin/env bash
# The wheel is the product: build it, install it into a fresh venv, and from outside the
# checkout run every CLI command a user starts with. Called by scripts/test.sh (so CI runs it
# every time); needs scripts/_install.sh's venv only to build the wheel.
# Usage: bash scripts/wheel-check.sh   (WHEEL_CHECK_DIR=DIR keeps the venv there between runs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
BASE_PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
WORK=${WHEEL_CHECK_DIR:-$(mktemp -d /tmp/opsdk-wheel.XXXXXX)}
[ -n "${WHEEL_CHECK_DIR:-}" ] || trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/dist" "$WORK/run"
rm -f "$WORK"/dist/*.whl
step() { echo "wheel-check: $*" >&2; }

step "building the wheel"
"$ROOT/.venv/bin/python" -m pip wheel --no-deps --no-build-isolation -q -w "$WORK/dist" . \
  2>&1 | grep -v -e '^WARNING: Location' -e '^ *$' >&2 || true
WHEEL=$(ls "$WORK"/dist/opsdk-*.whl)
# Every package of the source tree is in the wheel (a hand-written list once missed two).
"$ROOT/.venv/bin/python" - "$WHEEL" <<'EOF'
import pathlib, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = {str(p.relative_to(".")) for p in pathlib.Path("opsdk").rglob("__init__.py")}
want |= {"opsdk/py.typed", *(str(p) for p in pathlib.Path("opsdk/templates").glob("*.j2"))}
missing = sorted(want - names)
if missing:
    sys.exit(f"wheel-check: the wheel lacks {', '.join(missing)}")
print(f"wheel-check: {pathlib.Path(sys.argv[1]).name}: {len(names)} files, every package",
      file=sys.stderr)
EOF

step "installing it into a fresh venv"
[ -x "$WORK/venv/bin/python" ] || "$BASE_PY" -m venv "$WORK/venv"
V="$WORK/venv/bin"
# torch stays at the CPU build (an unpinned torch pulls a multi-GB CUDA build).
echo "torch==2.13.0" > "$WORK/constraints.txt"
"$V/python" -m pip install --disable-pip-version-check -q --force-reinstall --no-deps "$WHEEL" \
  2>&1 | grep -v '^WARNING: Location' >&2 || true
"$V/python" -m pip install --disable-pip-version-check -q -c "$WORK/constraints.txt" \
  "${WHEEL}[torch,onnx]" 2>&1 | grep -v '^WARNING: Location' >&2 || true

# From outside the checkout: the installed package, not the source tree, answers.
cd "$WORK/run"
cp "$ROOT"/examples/conv_net.py "$ROOT"/examples/_harness.py .
export PATH="$V:$PATH" TVM_NUM_THREADS=${TVM_NUM_THREADS:-2}
run() {
  step "\$ $*"
  local log="$WORK/run/last.log"
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "wheel-check: FAILED: $*" >&2
    exit 1
  fi
  tail -n 3 "$log" | sed 's/^/    /' >&2
  # Quiet by default: no third-party Python warning, no TVM log line ("[hh:mm:ss] file.cc:").
  if grep -E '[A-Za-z]+Warning: |^\[[0-9:]{8}\] ' "$log" >&2; then
    echo "wheel-check: FAILED: noise above from: $*" >&2
    exit 1
  fi
}
"$V/python" -c "import opsdk, sys; assert '$ROOT' not in opsdk.__file__, opsdk.__file__"
run opsdk --help
run opsdk --version
run opsdk list
run opsdk verify gelu --target x86 --dtypes float32 --examples 3 --quiet
run opsdk new-op swish_w --kind elementwise --targets x86
run opsdk verify swish_w --module swish_w --target x86 --dtypes float32 --examples 2 --quiet
SMALL=(--model-arg channels=8 --model-arg size=12)
run opsdk build conv_net.py --target x86 -o art "${SMALL[@]}"
run opsdk run art
run opsdk quantize conv_net.py --calibration 4 "${SMALL[@]}"
run opsdk explain --model conv_net.py --no-asm --no-profile "${SMALL[@]}"
echo "wheel-check: ok (the installed wheel ran every command above)" >&2
