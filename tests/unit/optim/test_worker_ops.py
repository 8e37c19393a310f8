"""Beside a GPU, the optimizer worker (DeepSpeed's CPU accelerator) loads the CPU ops set-up built and never
compiles one: DeepSpeed's install, made under the GPU's accelerator, has none it would use there.

A GPU machine's install is simulated by its record: DeepSpeed's ``git_version_info.accelerator_name``
set to "cuda", with every op recorded as installed (as set-up's install under CUDA leaves it). The ops
set-up "built" for the CPU accelerator are copies of this machine's installed CPU ops, recorded the way
``deepspeed_compat.build_for_set_up`` records a build, so nothing compiles here."""
import importlib.util
import os
import shutil
import subprocess
import sys
import types

import deepspeed.accelerator
import deepspeed.git_version_info
import pytest
import torch
from deepspeed.ops.op_builder.builder import OpBuilder

from ds_greedysnake import deepspeed_compat, prebuilt_ops
from ds_greedysnake.optim import updates
from ds_greedysnake.deepspeed_compat import AdamHyperparameters, AioSettings
from ds_greedysnake.storage.host_memory import HostArena, SharedHostMemory
from ds_greedysnake.storage.ssd import IoCounters

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HYPER = AdamHyperparameters(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)

# Loaded first in every process of the simulated GPU machine (a sitecustomize on PYTHONPATH): the install
# record says "cuda", and a JIT build leaves a mark and fails.
_GPU_INSTALL = """
import os
import deepspeed.git_version_info as record
from deepspeed.ops.op_builder.builder import OpBuilder
record.accelerator_name = "cuda"

def jit_load(builder, verbose=True):
    open(os.environ["JIT_MARK"], "a").write(builder.name + "\\n")
    raise RuntimeError("a JIT build of " + builder.name)

OpBuilder.jit_load = jit_load
"""


class _Accelerator:
    def __init__(self, name):
        self._name = name

    def device_name(self):
        return self._name


def _record_cpu_builds(folder) -> dict:
    """Copies of this machine's installed CPU ops, recorded as set-up's CPU builds; op -> copied file."""
    from deepspeed.ops.op_builder import cpu as cpu_builders
    copies = {}
    for name in deepspeed_compat.WORKER_OPS:
        module = getattr(cpu_builders, deepspeed_compat._BUILDERS[name])().absolute_name()
        installed = importlib.util.find_spec(module).origin  # DeepSpeed's install: found, not imported
        copy = os.path.join(folder, "cpu", name, os.path.basename(installed))
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        shutil.copy(installed, copy)
        prebuilt_ops.record("cpu", prebuilt_ops.BuiltOp(
            name=name, module=module.rpartition(".")[2], file=copy, deepspeed=deepspeed.__version__,
            torch=torch.__version__, python=sys.implementation.cache_tag))
        copies[name] = copy
    return copies


@pytest.fixture
def gpu_install(monkeypatch):
    """This process as the training process of a GPU machine: CUDA current, DeepSpeed installed for it."""
    monkeypatch.setattr(deepspeed.git_version_info, "accelerator_name", "cuda")
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _Accelerator("cuda"))
    monkeypatch.delenv(deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV, raising=False)  # the suite sets it


def _host() -> SharedHostMemory:
    return SharedHostMemory(HostArena({}, 0, None), HostArena({}, 0, None))


@pytest.mark.slow
def test_beside_a_gpu_install_the_worker_loads_the_cpu_ops_set_up_built(monkeypatch, tmp_path):
    monkeypatch.setenv(prebuilt_ops.FOLDER_ENV, str(tmp_path / "ops"))
    copies = _record_cpu_builds(str(tmp_path / "ops"))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_GPU_INSTALL)
    mark = tmp_path / "jit_builds"
    monkeypatch.setenv("JIT_MARK", str(mark))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), REPO]))
    with monkeypatch.context() as patched:
        patched.setattr(deepspeed.git_version_info, "accelerator_name", "cuda")
        patched.setattr(deepspeed.accelerator, "get_accelerator", lambda: _Accelerator("cuda"))
        patched.delenv(deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV, raising=False)
        assert deepspeed_compat.missing_worker_ops() == {}
        worker = updates.WorkerUpdater(IoCounters(), str(tmp_path), AioSettings(), HYPER, True,
                                       updates.BufferSizes(8, 8, 8), 1, _host())
    try:
        # Up ("ready"): it made its aio handles and its CPU Adam. Which files did it map?
        mapped = open(f"/proc/{worker._process.pid}/maps").read()
        for name, copy in copies.items():
            assert copy in mapped, f"the worker did not load set-up's {name} ({copy})"
        installed_ops = os.path.join(os.path.dirname(deepspeed.__file__), "ops")
        assert installed_ops not in mapped, "the worker loaded an op from DeepSpeed's GPU install"
    finally:
        worker.close()
    assert not mark.exists(), f"the worker ran a JIT build: {mark.read_text()}"


def test_without_them_the_worker_is_not_started_and_the_error_names_the_set_up_command(gpu_install, monkeypatch,
                                                                                      tmp_path):
    monkeypatch.setenv(prebuilt_ops.FOLDER_ENV, str(tmp_path / "none"))
    started = []
    monkeypatch.setattr(updates.subprocess, "Popen", lambda *args, **kwargs: started.append(args))
    with pytest.raises(deepspeed_compat.NativeOpNotPrebuiltError) as raised:
        updates.WorkerUpdater(IoCounters(), str(tmp_path), AioSettings(), HYPER, True, updates.BufferSizes(8, 8, 8), 1,
                              _host())
    message = str(raised.value)
    assert "installed for cuda" in message and "pin_memory, async_io, cpu_adam" in message
    assert "`python scripts/native_ops.py build --accelerator cpu`" in message and "bash scripts/setup.sh" in message
    assert str(tmp_path / "none" / "cpu") in message
    assert started == []


def test_a_build_for_another_torch_counts_as_missing(gpu_install, monkeypatch, tmp_path):
    monkeypatch.setenv(prebuilt_ops.FOLDER_ENV, str(tmp_path / "ops"))
    _record_cpu_builds(str(tmp_path / "ops"))
    assert deepspeed_compat.missing_worker_ops() == {}
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    missing = deepspeed_compat.missing_worker_ops()
    assert sorted(missing) == sorted(deepspeed_compat.WORKER_OPS)
    assert "torch 0.0.1" in missing["cpu_adam"]


def test_a_worker_that_would_compile_is_refused_with_the_build_command(monkeypatch, tmp_path):
    # The worker itself (CPU accelerator current), beside a GPU install, with no set-up build: its
    # environment forbids compiling, and the refusal names the command that builds its ops.
    env = updates.worker_environment(base={}, device_type="cuda")
    monkeypatch.setenv(deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV, env[deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV])
    monkeypatch.setenv(prebuilt_ops.FOLDER_ENV, str(tmp_path / "none"))
    monkeypatch.setattr(deepspeed.git_version_info, "accelerator_name", "cuda")
    monkeypatch.setattr(deepspeed_compat, "_SET_UP_MODULES", {})
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})  # DeepSpeed's cache of this session's loads
    with pytest.raises(deepspeed_compat.NativeOpNotPrebuiltError,
                       match=r"cpu_adam op is not prebuilt .*`python scripts/native_ops.py build --accelerator cpu`"):
        deepspeed_compat.load_native_op("cpu_adam")


def test_on_a_cpu_machine_the_worker_environment_is_as_before():
    env = updates.worker_environment(base={"PATH": "/bin"}, device_type="cpu")
    assert env == dict({"PATH": "/bin"}, **updates.WORKER_HIDDEN_ACCELERATORS)


def test_a_set_up_build_is_recorded_where_the_worker_looks(monkeypatch, tmp_path):
    # DeepSpeed's JIT build stands in: it builds into TORCH_EXTENSIONS_DIR, as torch does, and returns the module.
    monkeypatch.setenv(prebuilt_ops.FOLDER_ENV, str(tmp_path))
    built_into = []

    def jit_load(builder, verbose=True):
        built_into.append(os.environ["TORCH_EXTENSIONS_DIR"])
        return types.SimpleNamespace(__name__=builder.name, __file__=str(tmp_path / "cpu" / "cpu_adam.so"))

    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu_adam.so").write_bytes(b"")
    monkeypatch.setattr(OpBuilder, "jit_load", jit_load)
    monkeypatch.setattr(deepspeed_compat, "_SET_UP_MODULES", {})
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    (op,) = deepspeed_compat.build_for_set_up(["cpu_adam"])
    assert built_into == [prebuilt_ops.folder("cpu")] == [str(tmp_path / "cpu")]
    assert os.environ.get("TORCH_EXTENSIONS_DIR") == before
    assert prebuilt_ops.read("cpu", "cpu_adam") == op
    assert (op.module, op.deepspeed, op.torch) == ("cpu_adam", deepspeed.__version__, torch.__version__)
    assert deepspeed_compat.set_up_op("cpu_adam", "cpu") == (op, "")
