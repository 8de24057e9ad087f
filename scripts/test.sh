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
"$PY" -m pytest -p no:cacheprovider -q "$@"
