#!/usr/bin/env bash
# The apt packages set-up needs (libaio-dev: DeepSpeed's async I/O op links against it); skips what is there.
# Called by setup.sh; on its own so that a test can run it with stand-ins for apt-get, dpkg and sudo.
set -euo pipefail
if ! dpkg -s libaio-dev >/dev/null 2>&1; then
    # An argument list, not "$SUDO VAR=value cmd": with SUDO empty, bash runs "VAR=value" as a command.
    SUDO=(); [ "$(id -u)" -ne 0 ] && SUDO=(sudo)
    "${SUDO[@]}" apt-get update -qq
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev
fi
