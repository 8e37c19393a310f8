"""The install step of scripts/setup.sh, run with stand-ins for dpkg, apt-get, id and sudo: a fresh
machine (no libaio-dev) must get it installed, as root and through sudo otherwise."""
import os
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_system_packages.sh"


def _stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run(tmp_path: Path, uid: int, installed: bool):
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    _stand_in(bin_dir, "dpkg", f"exit {0 if installed else 1}")
    _stand_in(bin_dir, "id", f"echo {uid}")
    _stand_in(bin_dir, "apt-get", f'echo "apt-get $* DEBIAN_FRONTEND=${{DEBIAN_FRONTEND:-}}" >> {log}')
    _stand_in(bin_dir, "sudo", f'echo "sudo" >> {log}; exec "$@"')
    env = {key: value for key, value in os.environ.items() if key != "DEBIAN_FRONTEND"}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    calls = log.read_text().splitlines() if log.exists() else []
    return result, calls


@pytest.mark.parametrize("uid, through_sudo", [(0, False), (1000, True)])
def test_installs_libaio_on_a_fresh_machine(tmp_path, uid, through_sudo):
    result, calls = _run(tmp_path, uid, installed=False)
    assert result.returncode == 0, result.stderr
    apt_calls = [call for call in calls if call.startswith("apt-get")]
    assert apt_calls == ["apt-get update -qq DEBIAN_FRONTEND=",
                         "apt-get install -y -qq libaio-dev DEBIAN_FRONTEND=noninteractive"]
    assert calls.count("sudo") == (2 if through_sudo else 0)


def test_skips_when_installed(tmp_path):
    result, calls = _run(tmp_path, 0, installed=True)
    assert result.returncode == 0, result.stderr
    assert calls == []
