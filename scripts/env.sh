# Sourced by the other scripts: the venv, the accelerator and where a missing native op would be built.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$REPO/.venv/bin:$PATH"
# setup.sh compiles DeepSpeed's native ops into the installed DeepSpeed; a run that finds one missing
# compiles it here instead (and logs that it does).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}"
# No GPU: DeepSpeed's CPU accelerator. With one, DeepSpeed detects CUDA by itself.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
