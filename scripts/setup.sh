#!/usr/bin/env bash
# Installs everything on a fresh machine; safe to run again (each step skips what is done).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"
mkdir -p .cache

# One set-up at a time (quickstart.sh and test.sh both run this): flock's lock dies with its holder.
exec 9>.cache/setup.lock
if ! flock -n 9; then
    echo "ds_greedysnake set-up: waiting for another set-up of $REPO to finish"
    flock 9
fi

bash "$REPO/scripts/install_system_packages.sh"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch first, pinned, so nothing later pulls another build (set TORCH_SPEC for a CUDA build).
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
# The [trl] extra: GreedySnakeSFTTrainer and its tests (trl brings datasets, pandas, pyarrow).
.venv/bin/pip install -q -e ".[trl]"

# DeepSpeed's native ops are compiled once, here, into the installed DeepSpeed (about 4 minutes on
# 2 cores); no training, test or benchmark process compiles them.
bash "$REPO/scripts/install_deepspeed.sh" "$REPO/.venv" "$REPO/.cache/deepspeed_build.log"
# DeepSpeed uses an installed op only under the accelerator it was installed for; the optimizer worker runs
# on the CPU one. Installed for a GPU, this builds the worker's CPU ops once (on a CPU machine: nothing).
.venv/bin/python scripts/native_ops.py worker
.venv/bin/python scripts/native_ops.py report
echo "ds_greedysnake set-up done"
