"""After set-up, training starts without compiling: one process, two ranks under DeepSpeed's launcher,
and ZeRO-Infinity, each with a fresh torch-extensions folder that holds only the locks dead builds left
(which must not hang them) and must stay so; and every process, with the launcher or without, loads
the one CPU Adam build set-up made (one SIMD flavour)."""
import json
import os
import subprocess
import sys

import pytest

from ds_greedysnake import deepspeed_compat
from helpers import free_port, leave_lock_of_a_dead_build, remove_shm_buffers

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "scripts", "train.py")
TINY = ["--steps", "1", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq-len", "16", "--vocab", "128",
        "--micro-batches", "2"]
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "deepspeed")
# What a launcher sets itself, and the test session's one-process stand-ins for it (tests/conftest.py).
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
PROBE = os.path.join(REPO, "tests", "e2e", "op_probe.py")


def run(tmp_path, under_launcher: bool, script: str, arguments) -> str:
    """Run ``script`` (one process, or two ranks under the launcher) compiling nothing; return its stdout."""
    extensions = tmp_path / "torch_extensions"
    locks = sorted(leave_lock_of_a_dead_build(extensions / name) for name in deepspeed_compat.NATIVE_OPS)
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in RANK_VARIABLES}
    # Compiling is an error here, not minutes (or a hang on those locks): a build would land in `extensions`.
    env.update(TORCH_EXTENSIONS_DIR=str(extensions), DS_ACCELERATOR="cpu", PYTHONPATH=REPO, MASTER_PORT=port,
               **{deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV: "1"})
    if under_launcher:
        env["LOCAL_SIZE"] = "2"
        command = [LAUNCHER, "--num_gpus", "2", "--master_port", port, script, *arguments]
    else:
        command = [sys.executable, script, *arguments]
    try:
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    finally:
        remove_shm_buffers(port)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "not prebuilt" not in output
    built = sorted(str(path) for path in extensions.rglob("*") if path.is_file())
    assert built == locks, "an op was built at run time"
    return done.stdout


@pytest.mark.parametrize("under_launcher, extra", [(False, ()), (True, ()), (False, ("--baseline",))],
                         ids=["one process", "two ranks under the launcher", "ZeRO-Infinity"])
def test_training_starts_without_compiling(tmp_path, under_launcher, extra):
    stdout = run(tmp_path, under_launcher, TRAIN, [*TINY, *extra, "--nvme-path", str(tmp_path / "nvme")])
    assert "step   1  loss" in stdout
    assert f"{2 if under_launcher else 1} rank(s)" in stdout


def test_every_process_with_or_without_the_launcher_loads_the_one_cpu_adam_build(tmp_path):
    probes = []
    for under_launcher in (False, True):
        stdout = run(tmp_path / str(under_launcher), under_launcher, PROBE, [])
        probes += [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("OP_PROBE ")]
    assert sorted(probe["rank"] or "-" for probe in probes) == ["-", "0", "1"]
    kernel = deepspeed_compat.load_native_op("cpu_adam")
    assert {probe["file"] for probe in probes} == {kernel.__file__}
    assert {probe["flavour"] for probe in probes} == {deepspeed_compat.cpu_adam_simd_flavour()}
