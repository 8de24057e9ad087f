#!/usr/bin/env bash
# The test suite (what CI runs): installs what it needs, then pytest with the `ci` profile.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_install.sh

export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
"$PY" -m ruff check .
"$PY" -m pytest -p no:cacheprovider -q "$@"
