#!/usr/bin/env bash
# Fills DIR with what the offline GPU machine (docs/cuda.md: Python 3.12, torch 2.11.0+cu130, transformers
# 5.17.0, no deepspeed, no pydantic, no libaio) lacks for scripts/gpu_check.sh --wheelhouse DIR. Run it
# where the package registries are reachable, with set-up done (its .venv builds DeepSpeed's wheel):
#
#     scripts/gpu_wheelhouse.sh .gpu_wheels            # for the GPU machine (cp312)
#     PYTHON_VERSION=3.11 scripts/gpu_wheelhouse.sh .gpu_wheels_311   # for a CPU dry run on this machine
#
# What it holds, and why each (what pip installs of it there depends on what the image already has:
# pip keeps an installed version that satisfies):
# - deepspeed 0.19.8 as a wheel built here from its sdist with DS_BUILD_OPS=0 (pure python; the ops are
#   built there by gpu_check.sh's set-up, for both accelerators);
# - its requirements the image lacks: pydantic, pydantic-core (binary), annotated-types, typing-inspection,
#   typing-extensions (pydantic's floor may be above the image's), hjson, and einops, msgpack (binary),
#   py-cpuinfo, which the image's list does not name (pip keeps the image's own where it has them);
# - transformers 5.24.0 (setup.py's pin; the image has 5.17.0; its needs, huggingface-hub>=1.31 and
#   tokenizers>=0.23.1,<0.24, are met by the image's 1.33.0 and 0.23.2) and peft 0.21.2 (pinned; the
#   image's version is not known);
# - setuptools, wheel and packaging (wheel's), so that `pip install -e .` builds in its isolated environment
#   from DIR alone (pip before 24 asks for wheel too for a project without pyproject.toml: the dry run of
#   2026-12-02 failed on it);
# - pytest, pluggy, iniconfig: the parity stage runs tests/e2e/test_parity.py's training, which imports pytest;
# - libaio1 and libaio-dev as .deb files (this Debian release's; the library is plain C on glibc), which
#   gpu_check.sh unpacks with dpkg -x into a prefix of its own.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="$(mkdir -p "${1:?usage: gpu_wheelhouse.sh DIR}" && cd "$1" && pwd)"
PY="${WHEELHOUSE_PYTHON:-$REPO/.venv/bin/python}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
DEEPSPEED="$(sed -n 's/.*"deepspeed==\([0-9.]*\)".*/\1/p' "$REPO/setup.py")"
TRANSFORMERS="$(sed -n 's/.*"transformers==\([0-9.]*\)".*/\1/p' "$REPO/setup.py")"
PEFT="$(sed -n 's/.*"peft==\([0-9.]*\)".*/\1/p' "$REPO/setup.py")"

# Pure and binary wheels for the target Python, none of their dependencies (each one is named here).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR" "transformers==$TRANSFORMERS" "peft==$PEFT" pydantic pydantic-core annotated-types \
    typing-inspection typing-extensions hjson einops msgpack py-cpuinfo setuptools wheel packaging pytest pluggy \
    iniconfig
# pydantic pins its core exactly: keep the core that the downloaded pydantic asks for.
core="$(unzip -p "$DIR"/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')"
if ! ls "$DIR"/pydantic_core-"$core"-*.whl >/dev/null 2>&1; then
    rm -f "$DIR"/pydantic_core-*.whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DIR" "pydantic-core==$core"
fi

# DeepSpeed has only an sdist: a pure wheel of it, no op compiled (DS_BUILD_OPS=0), on the CPU accelerator.
if ! ls "$DIR"/deepspeed-"$DEEPSPEED"-*.whl >/dev/null 2>&1; then
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir \
        -w "$DIR" "deepspeed==$DEEPSPEED"
fi

# libaio as .deb files (apt-get download needs no root and installs nothing).
(cd "$DIR" && apt-get download -q libaio1 libaio-dev >/dev/null)

echo "gpu_wheelhouse: $DIR holds $(du -sh "$DIR" | cut -f1):"
ls -1 "$DIR"
size=$(du -sm "$DIR" | cut -f1)
if [ "$size" -ge 60 ]; then
    echo "gpu_wheelhouse: $DIR is ${size} MiB, over the 60 MiB that may travel" >&2
    exit 1
fi
