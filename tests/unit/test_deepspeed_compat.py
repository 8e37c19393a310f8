"""Fails loudly when a DeepSpeed release drops a private piece greedysnake relies on."""
import deepspeed
import pytest
import torch

from ds_greedysnake import deepspeed_compat


def test_pinned_release():
    assert deepspeed.__version__ == deepspeed_compat.CHECKED_DEEPSPEED_VERSION


def test_internals_present():
    deepspeed_compat.check_deepspeed_internals()


def test_cpu_adam_kernel_matches_torch_adamw():
    hyper = deepspeed_compat.AdamHyperparameters(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    kernel = deepspeed_compat.CpuAdamKernel(hyper, adamw_mode=True)
    torch.manual_seed(0)
    params = torch.randn(1000)
    reference = torch.nn.Parameter(params.clone())
    optimizer = torch.optim.AdamW([reference], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    exp_avg, exp_avg_sq = torch.zeros(1000), torch.zeros(1000)
    for step in range(1, 4):
        grads = torch.randn(1000)
        kernel.update(step, hyper, params, grads.clone(), exp_avg, exp_avg_sq)
        reference.grad = grads
        optimizer.step()
    assert torch.allclose(params, reference.detach(), rtol=1e-6, atol=1e-7)


def test_locked_buffers_bypass_bounce_copies_and_a_small_memlock_limit_is_named(monkeypatch):
    import pytest
    handle = deepspeed_compat.new_aio_handle(deepspeed_compat.AioSettings())
    buffer = deepspeed_compat.new_locked_buffer(handle, 1 << 20)
    if buffer is not None:  # the CPU accelerator: locked by the handle, page-aligned
        assert buffer.data_ptr() % 4096 == 0 and buffer.numel() == 1 << 20
        deepspeed_compat.free_locked_buffer(handle, buffer)
    monkeypatch.setattr(deepspeed_compat.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(deepspeed_compat.resource, "getrlimit", lambda _: (8 << 20, 8 << 20))
    with pytest.raises(MemoryError, match=r"memlock limit is 8388608 bytes: raise it \(ulimit -l"):
        deepspeed_compat._check_memlock(64 << 20)
    deepspeed_compat._check_memlock(1 << 20)  # within the limit: fine


def test_op_builds_read_torch_arch_suffixes_as_deepspeed_can(monkeypatch):
    """The GPU machine's image sets TORCH_CUDA_ARCH_LIST=9.0a, on which DeepSpeed 0.19.8's CUDA op build
    aborts (its compute_capability_args parses "0a" as an int; seen there on 2026-12-04): set-up's build
    hands it the numeric architecture, which it reads."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

    builder = AsyncIOBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError):
        builder.compute_capability_args()
    for value, read in (("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("8.0 9.0 9.0a", "8.0;9.0"),
                        ("10.0f;12.0", "10.0;12.0"), ("7.5;8.6", "7.5;8.6")):
        assert deepspeed_compat.builder_arch_list(value) == read
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", deepspeed_compat.builder_arch_list(value))
        builder.compute_capability_args()  # no ValueError


def test_a_profiled_zero_3_method_that_disappears_is_named(monkeypatch):
    """The planner's ZeRO-3 profile (profile_zero_step) wraps stage 3's methods by name: a release without one
    fails here, naming it, not as a silently empty profile."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    monkeypatch.delattr(DeepSpeedZeroOptimizer_Stage3, "_optimizer_step")
    with pytest.raises(deepspeed_compat.DeepSpeedInternalsError, match="_optimizer_step"):
        deepspeed_compat.check_deepspeed_internals()


def test_a_profiled_zero_3_function_that_disappears_is_named(monkeypatch):
    """The reduction's reduce-scatter is a function stage 3 imported by name: its module's name is wrapped,
    and a release without it fails here, naming it."""
    import deepspeed.runtime.zero.stage3 as stage3
    monkeypatch.delattr(stage3, "reduce_scatter_coalesced")
    with pytest.raises(deepspeed_compat.DeepSpeedInternalsError, match="stage3.reduce_scatter_coalesced"):
        deepspeed_compat.check_deepspeed_internals()


def test_the_profile_wraps_a_module_function_and_puts_it_back(monkeypatch):
    import deepspeed.runtime.zero.stage3 as stage3
    monkeypatch.setattr(stage3, "reduce_scatter_coalesced", lambda tensors, group=None: ["reduced", *tensors])
    stand_in = stage3.reduce_scatter_coalesced
    with deepspeed_compat.profile_zero_step() as profile:
        assert stage3.reduce_scatter_coalesced is not stand_in  # what stage 3 calls by name is timed
        assert stage3.reduce_scatter_coalesced(["gradient"]) == ["reduced", "gradient"]
    assert stage3.reduce_scatter_coalesced is stand_in
    assert profile.calls["gradient reduce-scatter"] == 1 and profile.seconds["gradient reduce-scatter"] > 0
