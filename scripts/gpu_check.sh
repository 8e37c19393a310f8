#!/usr/bin/env bash
# The CUDA path, checked on a machine with one CUDA GPU, in one go:
#
#     scripts/gpu_check.sh [OUT_DIR]                  # default results/gpu_check/
#     scripts/gpu_check.sh --cpu-dry-run [OUT_DIR]    # no GPU: the same stages on DeepSpeed's CPU accelerator
#     scripts/gpu_check.sh [--cpu-dry-run] --wheelhouse DIR [OUT_DIR]
#                                                     # offline: installs from DIR alone (scripts/gpu_wheelhouse.sh)
#                                                     # into $GPU_CHECK_PYTHON (default python3), libaio from its .debs
#
# 1. Set-up, from a clean tree: a virtual environment (.venv_gpu, or $GPU_CHECK_PYTHON's), a CUDA build of
#    torch ($TORCH_SPEC, default torch==2.13.0: PyPI's Linux wheel is the CUDA one; $PIP_OPTIONS for an
#    offline wheelhouse, e.g. "--no-index --find-links /wheels"), this package, and DeepSpeed's native ops
#    built for both accelerators (the GPU build of async_io needs a CUDA toolkit: nvcc and headers, found
#    through CUDA_HOME; the optimizer worker's CPU build goes to its own folder: scripts/native_ops.py build).
# 2. Then, within CHECK_SECONDS (default 330) from the script's start, set-up included, each stage under its
#    own timeout:
#    fp32 and bf16 parity against plain PyTorch on the GPU; the one-rank A/B of ssd_bound at M=1 and 8
#    against ZeRO-Infinity (scripts/bench/ab_bench/ab_bench.py); a profile of one step (the share of each layer's
#    host-to-device copy hidden under compute); with the time left, the LoRA row at M=8 (its step against
#    its own floor, a Chrome trace of the median step).
# 3. OUT_DIR gets one JSON per stage, gpu_check.json (everything) and report.md (a short table).
#
# A failed stage does not stop the others; the exit status is that of the first failed stage.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

DRY_RUN=0
WHEELHOUSE=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-dry-run) DRY_RUN=1; shift ;;
        --wheelhouse) WHEELHOUSE="$(cd "${2:?--wheelhouse DIR}" && pwd)"; shift 2 ;;
        *) break ;;
    esac
done
started=$(date +%s)
OUT="$(mkdir -p "${1:-$REPO/results/gpu_check}" && cd "${1:-$REPO/results/gpu_check}" && pwd)"
# The whole check, set-up included, from the script's start (one device command of at most 5 minutes).
# 330 s: a machine's start took 30 s on 2026-12-04, so two tries still fit in 15 minutes of device time.
CHECK_SECONDS="${CHECK_SECONDS:-330}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}"
export NVME_PATH="${GPU_CHECK_NVME:-$REPO/.nvme_swap/gpu_check}"
mkdir -p "$NVME_PATH"
rm -f "$OUT"/stages.tsv

log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }

# ----------------------------------------------------------------------------- 1. set-up
setup_started=$started
if [ "$DRY_RUN" = 1 ]; then
    export DS_ACCELERATOR=cpu
    PY="${GPU_CHECK_PYTHON:-$REPO/.venv/bin/python}"
    log "CPU dry run with $PY: no CUDA torch installed, DS_ACCELERATOR=cpu"
else
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu_check: no CUDA GPU here (nvidia-smi finds none); run with --cpu-dry-run instead" >&2
        exit 2
    fi
    nvidia-smi -L
    if [ -n "$WHEELHOUSE" ]; then
        PY="${GPU_CHECK_PYTHON:-python3}"  # offline: the machine's own Python and torch
    elif [ -n "${GPU_CHECK_PYTHON:-}" ]; then
        PY="$GPU_CHECK_PYTHON"
    else
        [ -x .venv_gpu/bin/python ] || python3 -m venv .venv_gpu || exit 3
        PY="$REPO/.venv_gpu/bin/python"
        if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
            log "installing ${TORCH_SPEC:-torch==2.13.0}"
            # shellcheck disable=SC2086
            "$PY" -m pip install -q ${PIP_OPTIONS:-} "${TORCH_SPEC:-torch==2.13.0}" || exit 3
        fi
    fi
    "$PY" - <<'PY' || exit 3
import sys, torch, torch.utils.cpp_extension as ext
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no GPU (torch.version.cuda = {torch.version.cuda}): "
             "install a CUDA build (TORCH_SPEC)")
if ext.CUDA_HOME is None:
    sys.exit("gpu_check: no CUDA toolkit (nvcc) found: DeepSpeed's async_io op includes CUDA headers when built for "
             "the GPU. Install the toolkit matching torch.version.cuda (" + str(torch.version.cuda) + ") and set CUDA_HOME")
PY
fi
# DeepSpeed's ops, built here for the training process's accelerator and the worker's (CPU) one, into a
# folder of this tree (ds_greedysnake/prebuilt_ops.py); after this no process may compile one.
export DS_GREEDYSNAKE_OPS_DIR="${DS_GREEDYSNAKE_OPS_DIR:-$REPO/.cache/gpu_check_ops}"
ACCELERATOR=cuda; [ "$DRY_RUN" = 1 ] && ACCELERATOR=cpu
if [ -n "$WHEELHOUSE" ]; then
    # Offline: libaio from its .deb files into a prefix of this tree, found by gcc (CPATH, LIBRARY_PATH),
    # DeepSpeed's libaio check (CFLAGS, LDFLAGS) and the loader (LD_LIBRARY_PATH); CUDA's stub libcuda last,
    # for a driver whose libcuda.so has no unversioned link.
    AIO="$REPO/.cache/libaio"
    mkdir -p "$AIO"  # dpkg -x makes no parent folder (a fresh tree has no .cache: the first GPU run failed here)
    for deb in "$WHEELHOUSE"/libaio*.deb; do dpkg -x "$deb" "$AIO" || exit 3; done
    lib="$AIO/usr/lib/x86_64-linux-gnu"
    export CPATH="$AIO/usr/include${CPATH:+:$CPATH}" LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}:${CUDA_HOME:-/usr/local/cuda}/lib64/stubs"
    export CFLAGS="-I$AIO/usr/include ${CFLAGS:-}" LDFLAGS="-L$lib ${LDFLAGS:-}"
    PY="${GPU_CHECK_PYTHON:-python3}"  # the machine's own, with its torch
    # Every pip this starts reads DIR alone: the image's setuptools runs `pip install -e .` again inside
    # `setup.py develop`, without the options below, and that inner pip went to the network (GPU run, 2026-12-04).
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"
    log "installing from $WHEELHOUSE into $("$PY" -c 'import sys; print(sys.prefix)')"
    # What the check runs on, pinned as setup.py pins it, with what they need from DIR or the image; then this
    # package without its other requirements (scipy for the planner, matplotlib for plots: the check uses
    # neither, and the image may lack them). pytest: the parity stage imports the parity test's module.
    pins="$(grep -oE '"(deepspeed|transformers|peft)==[0-9.]+"' setup.py | tr -d '"' | tr '\n' ' ') pytest"
    # shellcheck disable=SC2086
    { "$PY" -m pip install --no-index --find-links "$WHEELHOUSE" --no-compile $pins \
        && "$PY" -m pip install --no-index --find-links "$WHEELHOUSE" --no-compile --no-deps -e .; } \
        > "$OUT/pip_install.log" 2>&1 || { tail -n 30 "$OUT/pip_install.log"; exit 3; }
    grep "^Successfully installed" "$OUT/pip_install.log"
    "$PY" -c "import ds_greedysnake, deepspeed, transformers, peft, accelerate, safetensors" || exit 3
elif [ "$DRY_RUN" = 0 ]; then
    # shellcheck disable=SC2086
    "$PY" -m pip install -q ${PIP_OPTIONS:-} -e . || exit 3
fi
log "building DeepSpeed's native ops for the $ACCELERATOR accelerator and the worker's"
"$PY" scripts/native_ops.py build --accelerator "$ACCELERATOR" > "$OUT/ops_build.log" 2>&1 &
ops_main=$!
ops_worker_status=0
if [ "$ACCELERATOR" != cpu ]; then
    "$PY" scripts/native_ops.py build --accelerator cpu --ops pin_memory async_io cpu_adam \
        > "$OUT/ops_build_worker.log" 2>&1 || ops_worker_status=$?
fi
wait "$ops_main" || { tail -n 40 "$OUT/ops_build.log"; exit 3; }
[ "$ops_worker_status" = 0 ] || { tail -n 40 "$OUT/ops_build_worker.log"; exit 3; }
tail -n 2 "$OUT/ops_build.log"
export DS_GREEDYSNAKE_REQUIRE_PREBUILT_OPS=1
"$PY" scripts/native_ops.py report || exit 3
"$PY" - "$OUT/setup.json" "$DRY_RUN" "$(( $(date +%s) - setup_started ))" <<'PY' || exit 3
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "scripts", "bench", "gpu_check"))
from gpu_check import _environment
json.dump({"dry_run": sys.argv[2] == "1", "seconds": int(sys.argv[3]), "environment": _environment()},
          open(sys.argv[1], "w"), indent=1)
PY

# ----------------------------------------------------------------------------- 2. the checks
checks_started=$(date +%s)
first_failure=0
stage() {  # stage NAME SECONDS COMMAND...: run under a timeout that also respects the overall budget
    local name=$1 limit=$2
    shift 2
    local left=$(( CHECK_SECONDS - 10 - ($(date +%s) - started) ))  # 10 s kept for the report
    if [ "$DRY_RUN" = 1 ]; then left=$limit; fi  # the CPU is not what the budget is for
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -le 0 ]; then
        log "$name: skipped, no time left"
        printf '%s\t%s\t%s\n' "$name" "skipped" 0 >> "$OUT/stages.tsv"
        return
    fi
    log "$name (at most ${limit}s)"
    local began=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local code=$?
    printf '%s\t%s\t%s\n' "$name" "$code" "$(( $(date +%s) - began ))" >> "$OUT/stages.tsv"
    log "$name: exit $code after $(( $(date +%s) - began ))s (log $OUT/$name.log)"
    tail -n 3 "$OUT/$name.log"
    if [ "$code" != 0 ] && [ "$first_failure" = 0 ]; then first_failure=$code; fi
}

if [ "$DRY_RUN" = 1 ]; then
    AB_OPTIONS=(--quick --micro-batches 1 8 --steps 1)
    LORA_OPTIONS=(--quick --steps 1)
    PROFILE_OPTIONS=(--small)
    PARITY_SECONDS=600 AB_SECONDS=1800 PROFILE_SECONDS=600
else
    # M=8 alone: on the H200 (2026-12-04) the A/B at M=8 took 85 s besides its machine probe, and set-up
    # about 100 s and each parity stage 35 s of the budget.
    AB_OPTIONS=(--micro-batches 8 --warmup 1 --steps 2)
    LORA_OPTIONS=(--warmup 1 --steps 3)
    PROFILE_OPTIONS=()
    PARITY_SECONDS=40 AB_SECONDS=120 PROFILE_SECONDS=45
fi
stage parity_fp32 "$PARITY_SECONDS" "$PY" scripts/bench/gpu_check/gpu_check.py parity --dtype fp32 --out "$OUT/parity_fp32.json" \
    --nvme-path "$NVME_PATH"
stage parity_bf16 "$PARITY_SECONDS" "$PY" scripts/bench/gpu_check/gpu_check.py parity --dtype bf16 --out "$OUT/parity_bf16.json" \
    --nvme-path "$NVME_PATH"
stage ab_ssd_bound "$AB_SECONDS" "$PY" scripts/bench/ab_bench/ab_bench.py --configs ssd_bound --ranks 1 --no-plot "${AB_OPTIONS[@]}" \
    --nvme-path "$NVME_PATH" --out-dir "$OUT/ab"
stage profile "$PROFILE_SECONDS" "$PY" scripts/bench/gpu_check/gpu_check.py profile --out "$OUT/profile.json" \
    --nvme-path "$NVME_PATH" "${PROFILE_OPTIONS[@]}"
# Last, in whatever time is left: the LoRA row at M=8 (frozen base, PEFT adapters), with greedysnake's step
# against its own floor and a Chrome trace of its median step.
stage ab_lora "$CHECK_SECONDS" "$PY" scripts/bench/ab_bench/ab_bench.py --configs lora --micro-batches 8 --ranks 1 --no-plot \
    "${LORA_OPTIONS[@]}" --nvme-path "$NVME_PATH" --out-dir "$OUT/ab_lora" --trace "$OUT/ab_lora/step.json"

# ----------------------------------------------------------------------------- 3. the report
"$PY" - "$OUT" <<'PY'
import json, os, sys
folder = sys.argv[1]
stages = {}
for line in open(os.path.join(folder, "stages.tsv")):
    name, code, seconds = line.rstrip("\n").split("\t")
    stages[name] = {"exit": int(code) if code.lstrip("-").isdigit() else code, "seconds": int(seconds)}
json.dump(stages, open(os.path.join(folder, "stages.json"), "w"), indent=1)
PY
"$PY" scripts/bench/gpu_check/gpu_check.py report "$OUT"
log "done: $OUT/gpu_check.json, $OUT/report.md"
exit "$first_failure"
