"""The optimizer worker never initialises an accelerator: it runs CPU Adam on host memory only."""
import os
import subprocess
import sys

import deepspeed.accelerator
import pytest

from ds_greedysnake import deepspeed_compat
from ds_greedysnake.optim import updates
from ds_greedysnake.deepspeed_compat import AdamHyperparameters, AioSettings
from ds_greedysnake.storage.host_memory import HostArena, SharedHostMemory
from ds_greedysnake.storage.ssd import IoCounters

# What the worker's first steps touch: DeepSpeed's accelerator, torch's CUDA state, an SSD buffer.
PROBE = """
import sys, tempfile, torch
from deepspeed.accelerator import get_accelerator
from ds_greedysnake.deepspeed_compat import AioSettings
from ds_greedysnake.storage.ssd import IoCounters, SsdStore
from ds_greedysnake.optim.updates import _check_no_accelerator
_check_no_accelerator()
SsdStore(tempfile.mkdtemp(dir=sys.argv[1]), AioSettings(), IoCounters(), "worker").buffer(1 << 16)
print(get_accelerator().device_name(), torch.cuda.is_initialized())
"""


class _Started(Exception):
    pass


class _Accelerator:
    def __init__(self, name):
        self.name = name

    def device_name(self):
        return self.name


@pytest.mark.slow
def test_the_worker_starts_with_every_accelerator_hidden(monkeypatch, tmp_path):
    # The training process runs on a GPU: its environment and its accelerator say so.
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv(deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV, raising=False)  # the suite sets it
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _Accelerator("cuda"))
    started = {}

    def popen(command, pass_fds, env):
        started.update(command=command, env=env)
        for descriptor in pass_fds:
            os.close(descriptor)
        raise _Started

    host = SharedHostMemory(HostArena({}, 0, None), HostArena({}, 0, None))
    hyper = AdamHyperparameters(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with monkeypatch.context() as patched, pytest.raises(_Started):
        patched.setattr(updates.subprocess, "Popen", popen)
        updates.WorkerUpdater(IoCounters(), str(tmp_path), AioSettings(), hyper, True, updates.BufferSizes(8, 8, 8), 1,
                              host)
    env = started["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["DS_ACCELERATOR"] == "cpu"
    # Beside a GPU it may compile no op: set-up built its CPU ones (checked before it started).
    assert env[deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV] == "1"
    assert env["PATH"] == os.environ["PATH"]  # the rest is inherited
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    probe = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], env=env, capture_output=True, text=True,
                           timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split()[-2:] == ["cpu", "False"]


def test_a_worker_that_finds_an_accelerator_refuses_to_run(monkeypatch):
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _Accelerator("cuda"))
    with pytest.raises(RuntimeError, match="CPU accelerator"):
        updates._check_no_accelerator()
