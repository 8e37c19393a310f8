"""Fails loudly when a DeepSpeed release drops a private piece greedysnake relies on."""
import deepspeed
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
