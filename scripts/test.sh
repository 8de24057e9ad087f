#!/usr/bin/env bash
# The test suite (what CI runs): installs what it needs, checks the built wheel, then pytest
# with the `ci` profile.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_install.sh

export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
"$PY" -m ruff check .
# The wheel is the product: built, installed in a fresh venv, every command run outside the tree.
[ $# -gt 0 ] || bash scripts/wheel-check.sh   # the whole suite only
# Tests are independent (own temporary folders, free ports): one worker per CPU, at most 4
# (each compiles and holds a TVM), 2 on CI's 2 cores; OPSDK_TEST_WORKERS=0 runs them in one
# process.
workers=${OPSDK_TEST_WORKERS:-$(n=$(nproc); echo $(( n < 4 ? n : 4 )))}
"$PY" -m pytest -p no:cacheprovider -q -n "$workers" --dist worksteal "$@"
