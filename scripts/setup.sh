#!/usr/bin/env bash
# Installs everything on a fresh machine; safe to run again (each step skips what is done).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"

bash "$REPO/scripts/install_system_packages.sh"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch first, pinned, so nothing later pulls another build (set TORCH_SPEC for a CUDA build).
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/pip install -q -e .

# Compile DeepSpeed's native ops now (about 3 minutes on 2 cores), not in the first training step.
.venv/bin/python - <<'PY'
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
if not AsyncIOBuilder().is_compatible(verbose=True):
    raise SystemExit("DeepSpeed's async_io op cannot build here: is libaio-dev installed?")
AsyncIOBuilder().load(verbose=False)
CPUAdamBuilder().load(verbose=False)
print("ds_greedysnake set-up done: DeepSpeed ops async_io and cpu_adam are built")
PY
