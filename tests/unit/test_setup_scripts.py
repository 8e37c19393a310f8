"""The install step of scripts/setup.sh, run with stand-ins for dpkg, apt-get, id and sudo: a fresh
machine (no libaio-dev) must get it installed, as root and through sudo otherwise."""
import os
import stat
import subprocess
import sys
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


# scripts/install_deepspeed.sh with stand-ins for the venv's python (the "prebuilt?" check) and pip.
BUILD_SCRIPT = SCRIPT.parent / "install_deepspeed.sh"
BUILD_VARIABLES = ("DS_BUILD_OPS", "DS_BUILD_AIO", "DS_BUILD_PIN_MEMORY", "DS_BUILD_CPU_ADAM", "DS_BUILD_SHM_COMM",
                   "DS_ENABLE_NINJA")


def _run_build(tmp_path: Path, prebuilt: bool, build_succeeds: bool = True, arch_list=None):
    venv_bin, log = tmp_path / "venv" / "bin", tmp_path / "calls.log"
    venv_bin.mkdir(parents=True)
    # The stand-in answers native_ops.py's arch-list as the real one does for "8.0;9.0a" (its own test below).
    _stand_in(venv_bin, "python", f'echo "python $*" >> {log}; '
                                  f'if [ "$2" = arch-list ]; then echo "8.0;9.0"; exit 0; fi; exit {0 if prebuilt else 1}')
    variables = " ".join(f"{name}=${{{name}:-}}" for name in BUILD_VARIABLES)
    _stand_in(venv_bin, "pip", f'echo "pip $*" >> {log}; echo "{variables} LDFLAGS=$LDFLAGS" >> {log}; '
                               f'echo "TORCH_CUDA_ARCH_LIST=${{TORCH_CUDA_ARCH_LIST:-}}" >> {log}; '
                               f'echo "compiling"; echo "error: the last line"; exit {0 if build_succeeds else 1}')
    env = {key: value for key, value in os.environ.items()
           if key not in BUILD_VARIABLES + ("LDFLAGS", "TORCH_CUDA_ARCH_LIST")}
    if arch_list is not None:
        env["TORCH_CUDA_ARCH_LIST"] = arch_list
    build_log = tmp_path / "build.log"
    result = subprocess.run(["bash", str(BUILD_SCRIPT), str(tmp_path / "venv"), str(build_log)], env=env,
                            capture_output=True, text=True)
    calls = log.read_text().splitlines() if log.exists() else []
    return result, calls, build_log


def _pinned_deepspeed() -> str:
    from ds_greedysnake.deepspeed_compat import CHECKED_DEEPSPEED_VERSION
    return CHECKED_DEEPSPEED_VERSION


def test_a_deepspeed_with_its_ops_prebuilt_is_kept(tmp_path):
    result, calls, _ = _run_build(tmp_path, prebuilt=True)
    assert result.returncode == 0, result.stderr
    assert calls == [f"python {SCRIPT.parent / 'native_ops.py'} check {_pinned_deepspeed()}"]


def test_builds_the_pinned_deepspeed_with_its_ops_against_the_installed_torch(tmp_path):
    result, calls, build_log = _run_build(tmp_path, prebuilt=False)
    assert result.returncode == 0, result.stderr
    assert calls[1] == (f"pip install --no-build-isolation --no-cache-dir --force-reinstall --no-deps "
                        f"deepspeed=={_pinned_deepspeed()}")
    variables = dict(item.split("=", 1) for item in calls[2].split(" LDFLAGS=")[0].split())
    assert variables == {"DS_BUILD_OPS": "0", "DS_BUILD_AIO": "1", "DS_BUILD_PIN_MEMORY": "1",
                         "DS_BUILD_CPU_ADAM": "1", "DS_BUILD_SHM_COMM": "1", "DS_ENABLE_NINJA": "1"}
    assert calls[2].split(" LDFLAGS=")[1].split() == ["-Wl,--no-as-needed", "-laio"]
    assert "compiling" in build_log.read_text()
    assert f"building DeepSpeed {_pinned_deepspeed()} with its native ops" in result.stdout


def test_a_failed_build_fails_set_up_with_the_end_of_its_log(tmp_path):
    result, _, build_log = _run_build(tmp_path, prebuilt=False, build_succeeds=False)
    assert result.returncode != 0
    assert "error: the last line" in result.stderr and f"full log: {build_log}" in result.stderr


def test_the_build_gets_an_arch_list_deepspeed_can_read(tmp_path):
    """A GPU image's TORCH_CUDA_ARCH_LIST=9.0a aborts DeepSpeed 0.19.8's op build (the H200's, 2026-12-04):
    set-up hands the build the numeric list and says so."""
    result, calls, _ = _run_build(tmp_path, prebuilt=False, arch_list="8.0;9.0a")
    assert result.returncode == 0, result.stderr
    assert calls[1] == f"python {SCRIPT.parent / 'native_ops.py'} arch-list 8.0;9.0a"
    assert "TORCH_CUDA_ARCH_LIST=8.0;9.0" in calls
    assert "TORCH_CUDA_ARCH_LIST=8.0;9.0a is read as 8.0;9.0" in result.stdout


def test_native_ops_arch_list_reads_as_deepspeed_does():
    result = subprocess.run([sys.executable, str(SCRIPT.parent / "native_ops.py"), "arch-list", "8.0;9.0a"],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "8.0;9.0"
