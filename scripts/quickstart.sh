#!/usr/bin/env bash
# Command 1 of the README: install everything, then train the built-in small GPT with greedysnake.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bash "$REPO/scripts/setup.sh"
python "$REPO/scripts/train.py" "$@"
