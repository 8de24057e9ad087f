#!/usr/bin/env bash
# The main job: verify every built-in op on the host (x86) and on emulated aarch64 targets,
# then the schedule rules of the kernels TVM's own ops lower to (matmul, conv2d, pool).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_install.sh

mkdir -p reports
status=0
for t in x86 arm arm-dotprod arm-sve; do
  "$PY" -m opsdk verify --target "$t" --report "reports/verify-$t.json" || status=1
done
for t in x86 arm; do
  "$PY" -m opsdk verify --kernels --target "$t" --report "reports/verify-kernels-$t.json" || status=1
done
exit $status
