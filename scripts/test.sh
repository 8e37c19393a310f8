#!/usr/bin/env bash
# Command 2 of the README (and what CI runs): set-up if needed, then every test, slow ones included.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bash "$REPO/scripts/setup.sh"
cd "$REPO"
# --durations: the slowest tests, so that a suite growing past its budget shows where.
python -m pytest -q -p no:cacheprovider --durations=25 tests "$@"
