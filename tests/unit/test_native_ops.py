"""DeepSpeed's native ops come prebuilt from set-up; an op DeepSpeed would compile at run time instead
is logged (or refused), and a build lock its dead owner left does not hang that build."""
import os
import subprocess
import sys
import textwrap

import deepspeed
import pytest

from ds_greedysnake import deepspeed_compat
from helpers import leave_lock_of_a_dead_build

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAVOURS = ("AVX512", "AVX2", "SVE", "NEON", "scalar")  # the names csrc/adam/cpu_adam_impl.cpp prints


def test_every_native_op_is_prebuilt_into_the_installed_deepspeed():
    status = deepspeed_compat.native_ops_status()
    assert {"async_io", "pin_memory", "cpu_adam"} <= set(status)
    assert [name for name, prebuilt in status.items() if not prebuilt] == [], \
        f"not prebuilt (run {deepspeed_compat.SETUP_COMMAND}): {status}"
    installed = os.path.dirname(deepspeed.__file__)
    for name in status:
        module = deepspeed_compat.load_native_op(name)
        assert os.path.dirname(module.__file__).startswith(installed), (name, module.__file__)


def test_cpu_adam_reports_the_flavour_it_was_built_for():
    assert deepspeed_compat.cpu_adam_simd_flavour() in FLAVOURS


def test_a_run_time_build_is_refused_when_prebuilt_ops_are_required(monkeypatch):
    calls = []
    jit_load = deepspeed_compat._reported_jit_load(lambda builder, verbose=True: calls.append(builder))
    monkeypatch.setenv(deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV, "1")
    builder = type("Builder", (), {"name": "cpu_adam"})()
    with pytest.raises(deepspeed_compat.NativeOpNotPrebuiltError, match=r"cpu_adam op is not prebuilt .* run "
                       r"`bash scripts/setup.sh`"):
        jit_load(builder)
    assert calls == []


def test_deepspeeds_jit_path_is_the_reported_one():
    from deepspeed.ops.op_builder.builder import OpBuilder
    assert getattr(OpBuilder.jit_load, "ds_greedysnake_reported", False)


# A DeepSpeed op that is not prebuilt, through DeepSpeed's own load() -> jit_load(); torch's compile
# step stands in as torch runs it around the build: FileBaton on <extensions root>/<op>/lock.
_RUN_TIME_BUILD = textwrap.dedent("""
    import os, sys, types
    import torch.utils.cpp_extension as cpp_extension
    from torch.utils.file_baton import FileBaton
    from ds_greedysnake import deepspeed_compat
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    def build_as_torch_does(name, **kwargs):
        baton = FileBaton(os.path.join(cpp_extension._get_build_directory(name, False), "lock"))
        if baton.try_acquire():
            baton.release()
        else:
            baton.wait()
        return types.SimpleNamespace(name=name)

    cpp_extension.load = build_as_torch_does

    class NotPrebuiltOp(CPUAdamBuilder):
        NAME = "ds_greedysnake_test_op"
        def __init__(self):
            super(CPUAdamBuilder, self).__init__(name=self.NAME)

    print("loaded", NotPrebuiltOp().load().name, flush=True)
""")


def test_a_lock_left_by_a_dead_build_does_not_hang_a_run_time_build(tmp_path):
    lock = leave_lock_of_a_dead_build(tmp_path / "ds_greedysnake_test_op")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=REPO)
    env.pop(deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV, None)
    done = subprocess.run([sys.executable, "-c", _RUN_TIME_BUILD], env=env, capture_output=True, text=True,
                          timeout=120)  # torch alone would wait forever
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "loaded ds_greedysnake_test_op" in done.stdout
    assert (f"ds_greedysnake_test_op op is not prebuilt in this install: DeepSpeed builds it at run time in "
            f"{tmp_path / 'ds_greedysnake_test_op'}") in output
    assert f"removed the stale build lock {lock}" in output
