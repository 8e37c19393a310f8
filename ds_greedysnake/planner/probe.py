"""Measure this machine for the planner: SSD rates through DeepSpeed's aio handle with the config's
``aio`` block, CPU Adam elements/s, the gradient hand-over's elements/s, host<->device copies (when
the device is not the host), and forward / forward+backward seconds of each layer kind of a model at
the micro-batch size.

    hardware = probe_machine("/path/on/ssd", ds_config, workload)   # a Hardware (to_dict() for JSON)

Times are medians of repeats after one warm-up: the planner predicts typical steps, not the best one.
"""
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable, Dict, Optional

import torch

from .. import deepspeed_compat
from ..ssd import IoCounters, SsdStore, aligned_buffer
from .cost_model import Workload
from .errors import PlannerError
from .hardware import Hardware, LayerTimes

MIB = 2**20


def _median_seconds(action: Callable[[], None], repeats: int, warmup: int = 1) -> float:
    times = []
    for index in range(warmup + repeats):
        started = time.perf_counter()
        action()
        if index >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def probe_ssd(folder: str, ds_config: dict, region_mib: int = 128, repeats: int = 3) -> Dict[str, float]:
    """Write and read one region whole, two ways: through SsdStore, as the engine transfers (a deep
    queue of chunks), and as one aio op per transfer, as ZeRO-3's swapper issues a tensor."""
    os.makedirs(folder, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="planner_probe_", dir=folder)
    try:
        store = SsdStore(scratch, ds_config, IoCounters(), "probe")
        region = store.create_region("whole", region_mib * MIB, "probe")
        buffer = store.new_buffer(region)
        buffer.fill_(7)
        rates = {"ssd_write_bytes_per_s": region.padded_bytes / _median_seconds(lambda: store.write(region, buffer),
                                                                                 repeats),
                 "ssd_read_bytes_per_s": region.padded_bytes / _median_seconds(lambda: store.read(region, buffer),
                                                                                repeats)}
        handle = deepspeed_compat.new_aio_handle(ds_config)
        plain = aligned_buffer(region.padded_bytes)  # not locked, as ZeRO-3's swapper's without pin_memory

        def one_op(kind: str):
            def run():
                issue = handle.pread if kind == "read" else handle.pwrite
                issue(plain, region.path, False, True, 0)  # async, then wait
                if handle.wait() != 1:
                    raise OSError(f"aio probe: a {kind} of {region.padded_bytes} bytes in {scratch} did not complete")
            return run

        for kind in ("write", "read"):
            rates[f"ssd_{kind}_bytes_per_s_single"] = region.padded_bytes / _median_seconds(one_op(kind), repeats)
        return rates
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def probe_adam(numel: int = 1 << 23, repeats: int = 5) -> float:
    """Elements/s of DeepSpeed's CPU Adam kernel on flat fp32 tensors, as the engine's worker runs it."""
    hyper = deepspeed_compat.AdamHyperparameters(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    kernel = deepspeed_compat.CpuAdamKernel(hyper, adamw_mode=True)
    tensors = [torch.randn(numel) for _ in range(4)]
    step = [0]

    def update():
        step[0] += 1
        kernel.update(step[0], hyper, *tensors)

    return numel / _median_seconds(update, repeats)


def probe_grad_handoff(numel: int = 1 << 22, repeats: int = 5) -> float:
    """Elements/s of the engine's gradient hand-over on the training path: copy the accumulated fp32
    gradient into host memory and take its squared norm (the engine's own ``squared_norm``, for
    clipping and the overflow check)."""
    from ..optimizer import squared_norm
    source, destination = torch.randn(numel), torch.empty(numel)

    def hand_over():
        destination.copy_(source)
        squared_norm(destination)

    return numel / _median_seconds(hand_over, repeats)


def probe_link(device: torch.device, num_bytes: int = 256 * MIB, repeats: int = 3) -> Optional[float]:
    """Host<->device copy rate (slower direction); None when the device is the host."""
    if device.type == "cpu":
        return None
    host = deepspeed_compat.pin_if_possible(torch.empty(num_bytes, dtype=torch.uint8))
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    synchronize = getattr(torch, device.type).synchronize

    def copy(destination, source):
        def run():
            destination.copy_(source, non_blocking=True)
            synchronize()
        return run

    slowest = max(_median_seconds(copy(on_device, host), repeats), _median_seconds(copy(host, on_device), repeats))
    return num_bytes / slowest


def probe_layers(workload: Workload, device: torch.device, repeats: int = 5) -> Dict[str, LayerTimes]:
    """Seconds per micro-batch of the embedding, one block and the head with the loss, run as the
    engine runs them: forward without a graph; recompute with a graph and backward, the gradients
    accumulating in place in views of one flat accumulator."""
    from ..models.gpt import Block, Embedding, GPTConfig, Head, lm_loss
    shape = workload.shape
    config = GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq_len, hidden=shape.hidden,
                       num_heads=shape.heads, num_layers=1, mlp_ratio=shape.mlp_ratio)
    dtype = {4: torch.float32, 2: torch.bfloat16}[workload.param_bytes]
    tokens = torch.randint(0, shape.vocab, (workload.micro_batch_size, shape.seq_len), device=device)
    hidden = torch.randn(workload.micro_batch_size, shape.seq_len, shape.hidden, device=device, dtype=dtype)
    synchronize = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
    times = {}
    for kind, module, layer_input in (("embedding", Embedding(config), tokens), ("block", Block(config), hidden),
                                      ("head", Head(config), hidden)):
        module = module.to(device=device, dtype=dtype)
        accumulator = torch.zeros(sum(p.numel() for p in module.parameters()), device=device, dtype=dtype)
        offset = 0
        for param in module.parameters():  # autograd adds each micro-batch's gradient into these views
            param.grad = accumulator[offset:offset + param.numel()].view_as(param)
            offset += param.numel()

        def forward():
            with torch.no_grad():
                module(layer_input)
            synchronize()

        def forward_backward():
            source = layer_input if kind == "embedding" else layer_input.detach().requires_grad_(True)
            output = module(source)
            if kind == "head":
                lm_loss(output, tokens).backward()
            else:
                output.backward(torch.ones_like(output))
            synchronize()

        times[kind] = LayerTimes(_median_seconds(forward, repeats), _median_seconds(forward_backward, repeats))
    return times


def probe_machine(nvme_path: str, ds_config: dict, workload: Optional[Workload] = None, quick: bool = False,
                  device: Optional[torch.device] = None) -> Hardware:
    """Everything the planner needs about this machine, as a Hardware; with a workload, its layers
    are timed too, and the block's forward sets the effective FLOP/s used for other shapes."""
    if not nvme_path or not os.path.isdir(nvme_path):
        raise PlannerError(f"the probe needs an existing folder on the SSD to measure, got {nvme_path!r}: set "
                           "zero_optimization.offload_param.nvme_path in ds_config (or --nvme-path)")
    device = device or deepspeed_compat.accelerator_device()
    rates = probe_ssd(nvme_path, ds_config, region_mib=32 if quick else 128, repeats=2 if quick else 3)
    adam = probe_adam(numel=(1 << 21) if quick else (1 << 23), repeats=3 if quick else 5)
    handoff = probe_grad_handoff(numel=(1 << 20) if quick else (1 << 22))
    link = probe_link(device, num_bytes=(64 if quick else 256) * MIB)
    layer_times, key, flops = {}, "", None
    if workload is not None:
        layer_times = probe_layers(workload, device, repeats=3 if quick else 5)
        key = workload.compute_key()
        block = next(layer for layer in workload.shape.layers if layer.kind == "block")
        flops = block.forward_flops_per_token * workload.tokens_per_micro_batch / layer_times["block"].forward_s
    if flops is None:
        flops = _matmul_flops(device)
    return Hardware(name=f"probe of {os.uname().nodename}", source=f"ds_greedysnake.planner.probe at "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {os.cpu_count()} CPUs, device {device}",
                    ssd_read_bytes_per_s=rates["ssd_read_bytes_per_s"],
                    ssd_read_bytes_per_s_single=rates["ssd_read_bytes_per_s_single"],
                    ssd_write_bytes_per_s=rates["ssd_write_bytes_per_s"],
                    ssd_write_bytes_per_s_single=rates["ssd_write_bytes_per_s_single"], adam_elements_per_s=adam,
                    device_flops_per_s=flops, host_device_bytes_per_s=link, grad_handoff_elements_per_s=handoff,
                    host_memory_bytes=_host_memory(),
                    layer_times=layer_times, layer_times_for=key,
                    notes=f"aio {deepspeed_compat.aio_settings(ds_config)}; SSD folder {nvme_path}")


def _matmul_flops(device: torch.device, size: int = 1024) -> float:
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    synchronize = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)

    def run():
        a @ b
        synchronize()

    return 2 * size ** 3 / _median_seconds(run, 5)


def _host_memory() -> Optional[float]:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None
