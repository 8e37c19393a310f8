# Sourced by the other scripts: the venv, the accelerator and where DeepSpeed's native ops are built.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$REPO/.venv/bin:$PATH"
# Native ops (async_io, cpu_adam) are compiled once into the repo's cache and reused.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}"
# No GPU: DeepSpeed's CPU accelerator. With one, DeepSpeed detects CUDA by itself.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
