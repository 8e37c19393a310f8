#!/usr/bin/env bash
# DeepSpeed, the release setup.py pins, with its native ops compiled in at install (DeepSpeed's own
# DS_BUILD_* path), so that no run compiles them: not the first training step, not a rank under the
# launcher, not a test. Called by setup.sh after `pip install -e .`; skips what is done. On its own so
# that a test can run it with stand-ins for python and pip.
#   usage: install_deepspeed.sh VENV BUILD_LOG
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$1"
BUILD_LOG="$2"
VERSION="$(sed -n 's/.*"deepspeed==\([0-9.]*\)".*/\1/p' "$REPO/setup.py")"
if [ -z "$VERSION" ]; then
    echo "ds_greedysnake set-up: setup.py pins no deepspeed==X.Y.Z" >&2
    exit 1
fi
if "$VENV/bin/python" "$REPO/scripts/native_ops.py" check "$VERSION"; then
    exit 0
fi
echo "ds_greedysnake set-up: building DeepSpeed $VERSION with its native ops (async_io, pin_memory, cpu_adam," \
     "shm comm) compiled in: a few minutes of every core, once (log: $BUILD_LOG)"
mkdir -p "$(dirname "$BUILD_LOG")"
# DeepSpeed 0.19.8's build parses each TORCH_CUDA_ARCH_LIST entry as numbers: torch's "9.0a" (which a GPU image
# may set) aborts it with a ValueError; it gets the numeric list instead.
if [ -n "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    arch_list="$("$VENV/bin/python" "$REPO/scripts/native_ops.py" arch-list "$TORCH_CUDA_ARCH_LIST")"
    if [ "$arch_list" != "$TORCH_CUDA_ARCH_LIST" ]; then
        echo "ds_greedysnake set-up: TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST is read as $arch_list for DeepSpeed's build"
        export TORCH_CUDA_ARCH_LIST="$arch_list"
    fi
fi
started=$SECONDS
# DS_BUILD_OPS=0 and one variable per op: only the ops greedysnake and ZeRO-Infinity load.
# DS_ENABLE_NINJA: compile each op's files in parallel (MAX_JOBS), not one by one.
# LDFLAGS: DeepSpeed's CPU build of async_io does not link libaio (its JIT build does), and the
#   linker may drop a library named before the objects unless told --no-as-needed.
# --no-build-isolation: build against the torch installed here (the pinned one), not a fresh download.
# --no-cache-dir: pip's wheel cache may hold a DeepSpeed built without the ops; and this build is for
#   this machine's CPU (-march=native, its SIMD width), so it must not be cached for another.
if ! env DS_BUILD_OPS=0 DS_BUILD_AIO=1 DS_BUILD_PIN_MEMORY=1 DS_BUILD_CPU_ADAM=1 DS_BUILD_SHM_COMM=1 \
        DS_ENABLE_NINJA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" LDFLAGS="${LDFLAGS:-} -Wl,--no-as-needed -laio" \
        "$VENV/bin/pip" install --no-build-isolation --no-cache-dir --force-reinstall --no-deps \
        "deepspeed==$VERSION" >"$BUILD_LOG" 2>&1; then
    tail -n 40 "$BUILD_LOG" >&2
    echo "ds_greedysnake set-up: building DeepSpeed $VERSION with its native ops failed; full log: $BUILD_LOG" >&2
    exit 1
fi
echo "ds_greedysnake set-up: DeepSpeed $VERSION built with its native ops in $((SECONDS - started)) s"
