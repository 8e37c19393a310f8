"""Measure this machine for the planner: SSD rates through DeepSpeed's aio handle with the config's
``aio`` block (and the engine's fixed cost per transfer), CPU Adam elements/s, a layer update's cost
beyond its transfers and Adam, how much training compute slows while the worker shares its cores,
the gradient hand-over's elements/s, host<->device copies (when the device is not the host), and
forward / forward+backward seconds of each layer kind of a model at the micro-batch size (and at
further micro-batch sizes, for a sweep over them).

    hardware = probe_machine("/path/on/ssd", settings, workload)   # a Hardware (to_dict() for JSON)
    hardware = probe_machine(path, settings, workload, more_micro_batch_sizes=(1, 4, 16))  # plan --saturated

Times are medians of repeats after one warm-up: the planner predicts typical steps, not the best one.
"""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Dict, Optional, Sequence, Tuple

import torch

from .. import deepspeed_compat
from ..storage import transfers
from ..config import training_threads_for, worker_threads_for
from ..settings import Settings
from ..storage.ssd import ALIGNMENT, IoCounters, SsdStore
from .cost_model import Workload
from .errors import PlannerError
from .device_memory import layer_working_set_bytes
from .hardware import Hardware, WorkloadTimes
from .timing import median_seconds as _median_seconds
from .timing import probe_layers  # noqa: F401  (also this module's API, as before)

MIB = 2**20


def probe_ssd(folder: str, aio: deepspeed_compat.AioSettings, region_mib: int = 128,
              repeats: int = 3) -> Dict[str, float]:
    """The engine's transfers through SsdStore (a deep queue of chunks) at five sizes, for a fixed cost
    per transfer plus a rate (``_per_transfer``); and one region whole as one aio op per transfer, as
    ZeRO-3's swapper issues a tensor."""
    os.makedirs(folder, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="planner_probe_", dir=folder)
    try:
        store = SsdStore(scratch, aio, IoCounters(), "probe")
        region = store.create_region("whole", region_mib * MIB, "probe")
        handle = deepspeed_compat.new_aio_handle(aio)
        # Pageable, as ZeRO-3's swapper's buffers without offload_param.pin_memory (aio bounces through
        # memory it locks itself): never registered with the accelerator, which the engine's buffers are.
        plain = _pageable_aligned(region.padded_bytes)
        plain.fill_(7)

        def one_op(kind: str):
            def run():
                issue = handle.pread if kind == "read" else handle.pwrite
                issue(plain, region.path, False, True, 0)  # async, then wait
                if handle.wait() != 1:
                    raise OSError(f"aio probe: a {kind} of {region.padded_bytes} bytes in {scratch} did not complete")
            return run

        rates = {f"ssd_{kind}_bytes_per_s_single": region.padded_bytes / _median_seconds(one_op(kind), repeats)
                 for kind in ("write", "read")}
        # Five sizes from a 32nd of the region to half of it: 4 to 64 MiB by default, around the engine's
        # layer and state-piece transfers (12-50 MB on ab_bench's ssd_bound). The time is not linear in the
        # size here (a 4 MiB read ran at half a 64 MiB one's rate): fitted over 16-64 MiB only, the line
        # put a 12.6 MB read at 13.8 ms against the 8-10 ms it takes (docs/planner.md).
        fractions = (32, 16, 8, 4, 2)
        sizes = [max(4096, region_mib * MIB // fraction // 4096 * 4096) for fraction in fractions]
        rates.update(_per_transfer(store, sizes, 2 * repeats, min_seconds=4.0 if repeats >= 3 else 1.0))
        return rates
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _pageable_aligned(num_bytes: int) -> torch.Tensor:
    base = torch.empty(num_bytes + ALIGNMENT, dtype=torch.uint8)
    offset = (-base.data_ptr()) % ALIGNMENT
    return base[offset:offset + num_bytes]


def _per_transfer(store: SsdStore, sizes, rounds: int, min_seconds: float = 0.0) -> Dict[str, float]:
    """Reads and writes of several region sizes through the engine's store, the sizes interleaved round
    after round; a line through every timing (``_fit_line``) gives the rate (its slope) and the fixed
    cost of a transfer (its intercept, at least 0). Here a transfer of the engine's layer size ran at
    55-70% of a 256 MiB one's rate. Interleaved and fitted over every point because this machine's disk
    drifts within seconds: a line through two sizes' medians, measured one size after the other, gave
    read rates of 1.1 to 2.5 GB/s in three probes within three minutes (docs/planner.md)."""
    regions = [store.create_region(f"fit{size}", size, "probe") for size in sizes]
    buffers = [store.new_buffer(region) for region in regions]  # kept to the end (see probe_update)
    points = {"read": [], "write": []}
    try:
        for buffer in buffers:
            buffer.fill_(7)
        # At least ``rounds`` after a warm-up round, and on until ``min_seconds`` have passed: the line is of
        # the disk over a few seconds, as long as a few training steps, not of one moment of its drift.
        probe_started, round_index = time.perf_counter(), 0
        while round_index <= rounds or time.perf_counter() - probe_started < min_seconds:
            round_index += 1
            for region, buffer in zip(regions, buffers):
                for kind, transfer in (("write", store.write), ("read", store.read)):
                    transfer_started = time.perf_counter()
                    transfer(region, buffer)
                    if round_index > 1:  # the first round warms up
                        points[kind].append((region.padded_bytes, time.perf_counter() - transfer_started))
    finally:
        for buffer in buffers:
            store.free_buffer(buffer)
    rates = {}
    for kind, timings in points.items():
        slope, intercept = _fit_line(timings)
        if slope <= 0:  # a disturbed measurement: the largest transfer's rate, no fixed cost
            largest = max(timings)
            slope, intercept = largest[1] / largest[0], 0.0
        rates[f"ssd_{kind}_bytes_per_s"] = 1.0 / slope
        rates[f"ssd_{kind}_seconds_per_transfer"] = max(0.0, intercept)
    return rates


def _fit_line(points) -> Tuple[float, float]:
    """A line (slope, intercept) of y over x through (x, y) points with at least two distinct x: the
    median of the slopes between every two points of different x, and the median intercept at that
    slope (Theil-Sen). Medians, so that a few transfers slowed by the disk's drift do not tilt the line:
    a least-squares line gave read intercepts of 1.5 to 14 ms in five probes within ten minutes here."""
    slopes = [(y2 - y1) / (x2 - x1) for index, (x1, y1) in enumerate(points) for x2, y2 in points[index + 1:]
              if x2 != x1]
    if not slopes:
        raise PlannerError("the SSD probe needs transfers of at least two sizes to fit a line")
    slope = statistics.median(slopes)
    return slope, statistics.median(y - slope * x for x, y in points)


def probe_update(folder: str, settings: Settings, numel: int, repeats: int = 5,
                 device_type: str = "cpu") -> Tuple[float, float]:
    """Layer updates as the engine's worker runs them, per element: (states in host memory: Adam with the
    gradient in host memory, the new weights cast and written; what the states' SSD round trip adds).
    Several updates of ``numel`` elements are queued on the engine's own ``UpdatePipeline``, so the next
    update's read overlaps the current one's Adam and writes, as in the worker."""
    from ..storage.host_memory import HostArena, SharedHostMemory
    from ..optim.update_pipeline import STATE_PIECE_NUMEL, UpdateBuffers, UpdatePipeline, piece_ranges
    from ..optim.updates import UpdateTask, plan_write

    os.makedirs(folder, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="planner_update_", dir=folder)
    threads = torch.get_num_threads()
    # The worker's own thread count (Adam and the cast run on it), its default depending on the accelerator.
    torch.set_num_threads(worker_threads_for(settings.greedysnake, device_type))
    layers, unlimited = 4, 1 << 62
    numels = [numel] * layers
    host = SharedHostMemory(HostArena.for_gradients(numels, unlimited),
                            HostArena.for_optimizer_states(numels, layers, unlimited))
    try:
        store = SsdStore(scratch, settings.aio, IoCounters(), "probe")
        hyper = deepspeed_compat.AdamHyperparameters(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        pipeline = UpdatePipeline(store, deepspeed_compat.CpuAdamKernel(hyper, adamw_mode=True),
                                  UpdateBuffers(store, numel, min(numel, STATE_PIECE_NUMEL), 0), host)
        ranges = piece_ranges(numel, STATE_PIECE_NUMEL)
        slots = [[[store.create_region(f"s{layer}_{slot}_p{piece}", 12 * (stop - start), "probe")
                   for piece, (start, stop) in enumerate(ranges)] for slot in (0, 1)] for layer in range(layers)]
        params = [store.create_region(f"p{layer}", 4 * numel, "probe") for layer in range(layers)]
        zeros = store.buffer(max(region.padded_bytes for region in slots[0][0]))
        zeros.zero_()
        for layer in range(layers):
            host.gradients.slot(layer, numel).normal_()
            host.optimizer_states.slot(layer, 3 * numel).zero_()
            for region in slots[layer][0]:
                store.write(region, zeros)
        store.free_buffer(zeros)
        step = [0]

        def sweep(on_ssd: bool) -> None:
            step[0] += 1
            committed = (step[0] - 1) % 2  # each sweep reads the slot the previous one wrote
            for layer in range(layers):
                state_in = slots[layer][committed] if on_ssd else None
                state_out = [plan_write(region) for region in slots[layer][1 - committed]] if on_ssd else None
                pipeline.add(UpdateTask(step[0] * layers + layer, layer, numel, torch.float32, state_in, state_out,
                                        STATE_PIECE_NUMEL, None, plan_write(params[layer]), step[0], hyper, 1.0))
            pipeline.drain()
            if not on_ssd:
                step[0] += 1  # keep the slot written last the one read next

        trials = {True: [], False: []}
        for _ in range(repeats):
            for on_ssd in (True, False):
                trials[on_ssd].append(_median_seconds(lambda: sweep(on_ssd), 3) / layers)
        in_host, through_ssd = statistics.median(trials[False]), statistics.median(trials[True])
        return in_host / numel, max(0.0, through_ssd - in_host) / numel
    finally:
        host.close()
        torch.set_num_threads(threads)
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


def probe_grad_handoff(numel: int = 1 << 22, repeats: int = 5, device: Optional[torch.device] = None) -> float:
    """Elements/s of the engine's gradient hand-over on the training path: copy the accumulated fp32
    gradient from the device into registered host memory on the transfer stream and take its squared
    norm (the engine's own ``squared_norm``, for clipping and the overflow check) where the gradient is,
    as ``LayerwiseAdam.receive_gradient`` does. On the CPU accelerator both are host memory."""
    from ..runtime.optimizer import squared_norm
    device = device or torch.device("cpu")
    copies = transfers.Transfers.for_device(device)
    source = torch.randn(numel, device=device)
    destination = transfers.host_buffer(4 * numel).view(torch.float32)

    def hand_over():
        copied = copies.to_host(source, destination)
        squared_norm(source)
        copied.wait()

    return numel / _median_seconds(hand_over, repeats)


def probe_zero_grad_reduce(device: torch.device, numel: int = 1 << 24, repeats: int = 5,
                           dtype: torch.dtype = torch.float32) -> Optional[float]:
    """Elements/s of ZeRO-3's gradient reduction after each micro-batch's backward where the device is the
    host, as DeepSpeed 0.19.8 runs it at one rank (seen in a profile of ab_bench's ZeRO-Infinity step:
    ``torch.cat`` of the bucket, gloo's reduce-scatter of it, then the add into the fp32 partition; 0.08 s
    per micro-batch of 26 M parameters here), in the compute lane. The reduce-scatter runs on a one-rank
    gloo group of this process alone, so a probe inside a launched job (``auto``) sends nothing to the
    other ranks. None when the device is not the host (the link lane carries it, ``horizontal_phases``)."""
    if device.type != "cpu":
        return None
    pieces = [torch.randn(numel // 8, dtype=dtype) for _ in range(8)]
    reduced = torch.empty(numel // 8 * 8, dtype=dtype)
    partition = torch.zeros(numel // 8 * 8, dtype=torch.float32)
    alone = torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1)

    def reduce():
        flat = torch.cat(pieces)
        # What torch.distributed.reduce_scatter_tensor (DeepSpeed's reduce_scatter_fn) runs on the group.
        alone._reduce_scatter_base(reduced, flat).wait()
        partition.add_(reduced)

    return numel // 8 * 8 / _median_seconds(reduce, repeats)


def probe_link(device: torch.device, num_bytes: int = 256 * MIB, repeats: int = 3) -> Optional[float]:
    """Host<->device copy rate (slower direction); None when the device is the host."""
    if device.type == "cpu":
        return None
    host = transfers.host_buffer(num_bytes)  # registered, as the engine's staging buffers
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    synchronize = getattr(torch, device.type).synchronize

    def copy(destination, source):
        def run():
            destination.copy_(source, non_blocking=True)
            synchronize()
        return run

    slowest = max(_median_seconds(copy(on_device, host), repeats), _median_seconds(copy(host, on_device), repeats))
    return num_bytes / slowest


# A stand-in for the optimizer worker's Adam while the probe times training beside it: elementwise passes over
# 64 MiB of fp32 (memory-bound, as CPU Adam is) on the worker's threads, in a process of its own.
_BUSY_WORKER = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
x, y = torch.ones(1 << 24), torch.ones(1 << 24)
print("ready", flush=True)
while True:
    x.mul_(0.999).add_(y, alpha=0.001)
"""


def probe_engine_cores(workload: Workload, device: torch.device, settings: Settings, repeats: int = 5,
                       all_threads_block_s: Optional[float] = None) -> Tuple[Optional[float], Optional[float]]:
    """On the CPU accelerator: (``engine_threads_slowdown``, ``compute_slowdown_sharing_cores``). The engine
    trains on ``training_threads`` (the cores less the worker's, by default), not torch's count the layer times
    are taken at: a block's forward+backward at those threads over at torch's (1.3-1.8 at hidden 640 here); and
    at those threads beside a stand-in for the worker's Adam on its threads (``_BUSY_WORKER``) over alone, the
    slow-down while the worker runs. Until issue 33 the second was one thread fewer over all of them, which
    stood in for both on this 2-core machine and missed the first where the worker was idle. (None, None)
    when the device is not the host.

    ``all_threads_block_s``: the block's forward+backward at torch's threads as ``probe_layers`` timed it for
    the layer times this ratio multiplies: the ratio is taken over that very timing, so that the engine's
    block is predicted at what the training threads measured. A ratio over a second all-threads timing of
    its own came out 1.40 and 1.77 in two probes of one workload (hidden 464, micro-batch 4) whose layer
    times' block took 15.8 and 14.9 ms, and the engine's compute was predicted at 0.83x (docs/planner.md)."""
    if device.type != "cpu":
        return None, None
    threads = torch.get_num_threads()
    training = training_threads_for(settings.greedysnake, device.type) or threads
    block = lambda: probe_layers(workload, device, repeats, kinds=("block",))["block"].forward_backward_s  # noqa: E731
    alone_all = block() if all_threads_block_s is None else all_threads_block_s
    torch.set_num_threads(training)
    try:
        alone = probe_layers(workload, device, 2 * repeats, kinds=("block",))["block"].forward_backward_s
        busy = subprocess.Popen([sys.executable, "-c", _BUSY_WORKER,
                                 str(worker_threads_for(settings.greedysnake, device.type))],
                                stdout=subprocess.PIPE, text=True)
        try:
            if busy.stdout.readline().strip() != "ready":
                raise PlannerError("the probe's stand-in for the optimizer worker did not start")
            beside = block()
        finally:
            busy.kill()
            busy.wait()
    finally:
        torch.set_num_threads(threads)
    return max(1.0, alone / alone_all), max(1.0, beside / alone)


# The largest working set (one layer's backward for one micro-batch) the probe times; larger micro-batch
# sizes are predicted from FLOP/s (their timing alone would take minutes on a CPU).
TIMED_WORKING_SET_BYTES = 1 << 30
TIMED_BLOCK_BYTES = 2 << 30


def timeable(workload: Workload) -> bool:
    """Whether the probe times this workload's layers: one block's parameters and the largest layer's
    working set (as this probe's plain softmax attention keeps it, with its scores) small enough to
    build and run here in seconds."""
    shape, tokens = workload.shape, workload.tokens_per_micro_batch
    block = next(layer for layer in shape.layers if layer.kind == "block")
    working_set = max(layer_working_set_bytes(layer, shape, tokens, workload.activation_bytes, keeps_scores=True)
                      for layer in shape.layers)
    return block.params * workload.param_bytes < TIMED_BLOCK_BYTES and working_set <= TIMED_WORKING_SET_BYTES


def probe_more_workloads(workload: Workload, micro_batch_sizes: Sequence[int], device: torch.device,
                         settings: Settings, repeats: int = 5) -> Dict[str, WorkloadTimes]:
    """The layers (and the shared-cores slow-down) at each further micro-batch size that ``timeable``
    allows: compute key -> WorkloadTimes, for a sweep over micro-batch sizes (``plan --saturated``)."""
    timed = {}
    for size in sorted(set(micro_batch_sizes) - {workload.micro_batch_size}):
        other = replace(workload, micro_batch_size=size)
        if timeable(other):
            layers = probe_layers(other, device, repeats)
            threads_slowdown, sharing = probe_engine_cores(other, device, settings, repeats,
                                                           layers["block"].forward_backward_s)
            timed[other.compute_key()] = WorkloadTimes(layers, sharing, threads_slowdown)
    return timed


def probe_machine(nvme_path: str, settings: Settings, workload: Optional[Workload] = None, quick: bool = False,
                  device: Optional[torch.device] = None, more_micro_batch_sizes: Sequence[int] = (),
                  layer_repeats: Optional[int] = None, zero_ds_config: Optional[dict] = None,
                  zero_probe_processes: int = 1) -> Hardware:
    """Everything the planner needs about this machine, as a Hardware; with a workload, its layers
    are timed too, and the block's forward sets the effective FLOP/s used for other shapes; with
    ``more_micro_batch_sizes``, the layers at each of those too (``Hardware.timed_workloads``).
    ``layer_repeats``: the layer timings' repeats (default 5, quick 3; each at least 0.02 s x repeats
    of forward and 0.04 s x repeats of forward and backward). With a workload and ``zero_ds_config`` (the ds_config
    ZeRO-Infinity would run), ZeRO-3's one-op SSD rates are fitted over the model's own op sizes
    (``probe_zero_ops``) and ZeRO-3 itself is timed on four of its blocks (``zero_probe``, 20-60 s per process;
    ``zero_probe_processes`` of them, each term their mean)."""
    if not nvme_path or not os.path.isdir(nvme_path):
        raise PlannerError(f"the probe needs an existing folder on the SSD to measure, got {nvme_path!r}: set "
                           "zero_optimization.offload_param.nvme_path in ds_config (or --nvme-path)")
    device = device or deepspeed_compat.accelerator_device()
    rates = probe_ssd(nvme_path, settings.aio, region_mib=32 if quick else 128, repeats=2 if quick else 3)
    adam = probe_adam(numel=(1 << 21) if quick else (1 << 23), repeats=3 if quick else 5)
    # One layer's update at the model's largest layer, at most 4 Mi elements (the probe's buffers stay
    # small; the cost is per element).
    largest = min(max(layer.params for layer in workload.shape.layers) if workload is not None else 1 << 22, 1 << 22)
    update_host, update_state_io = probe_update(nvme_path, settings, largest, repeats=3 if quick else 5,
                                                device_type=device.type)
    handoff = probe_grad_handoff(numel=(1 << 20) if quick else (1 << 22), device=device)
    link = probe_link(device, num_bytes=(64 if quick else 256) * MIB)
    zero_reduce = probe_zero_grad_reduce(device, numel=(1 << 22) if quick else (1 << 24))
    layer_times, key, flops, sharing, threads_slowdown, more, zero_terms = {}, "", None, None, None, {}, {}
    if workload is not None:
        repeats = layer_repeats or (3 if quick else 5)
        layer_times = probe_layers(workload, device, repeats=repeats)
        threads_slowdown, sharing = probe_engine_cores(workload, device, settings, repeats,
                                                       layer_times["block"].forward_backward_s)
        key = workload.compute_key()
        block = next(layer for layer in workload.shape.layers if layer.kind == "block")
        flops = block.forward_flops_per_token * workload.tokens_per_micro_batch / layer_times["block"].forward_s
        more = probe_more_workloads(workload, more_micro_batch_sizes, device, settings, repeats)
        if zero_ds_config is not None:
            from .zero_probe import probe_zero_engine, probe_zero_ops, zero_op_sizes
            reads, writes = zero_op_sizes(workload, settings)
            if reads or writes:
                rates.update(probe_zero_ops(nvme_path, settings.aio, sorted(set(reads) | set(writes)),
                                            min_seconds=1.0 if quick else 2.0))
            try:
                zero_terms = probe_zero_engine(zero_ds_config, workload, nvme_path, processes=zero_probe_processes)
            except PlannerError as error:  # said, and the prediction goes on from plain rates
                print(f"warning: {error}\nZeRO-Infinity is predicted without ZeRO-3's own costs", file=sys.stderr)
    if flops is None:
        flops = _matmul_flops(device)
    return Hardware(name=f"probe of {os.uname().nodename}", source=f"ds_greedysnake.planner.probe at "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {os.cpu_count()} CPUs, device {device}",
                    ssd_read_bytes_per_s=rates["ssd_read_bytes_per_s"],
                    ssd_read_bytes_per_s_single=rates["ssd_read_bytes_per_s_single"],
                    ssd_write_bytes_per_s=rates["ssd_write_bytes_per_s"],
                    ssd_write_bytes_per_s_single=rates["ssd_write_bytes_per_s_single"], adam_elements_per_s=adam,
                    ssd_read_seconds_per_transfer=rates["ssd_read_seconds_per_transfer"],
                    ssd_write_seconds_per_transfer=rates["ssd_write_seconds_per_transfer"],
                    update_seconds_per_element=update_host, update_state_io_seconds_per_element=update_state_io,
                    compute_slowdown_sharing_cores=sharing, engine_threads_slowdown=threads_slowdown,
                    device_flops_per_s=flops, host_device_bytes_per_s=link, grad_handoff_elements_per_s=handoff,
                    zero_grad_reduce_elements_per_s=zero_terms.get("zero_grad_reduce_elements_per_s", zero_reduce),
                    zero_seconds_per_fetch=zero_terms.get("zero_seconds_per_fetch"),
                    zero_read_seconds_by_size=zero_terms.get("zero_read_seconds_by_size", {}),
                    zero_optimizer_seconds_per_element=zero_terms.get("zero_optimizer_seconds_per_element", {}),
                    ssd_read_seconds_by_op_size=rates.get("ssd_read_seconds_by_op_size", {}),
                    ssd_write_seconds_by_op_size=rates.get("ssd_write_seconds_by_op_size", {}),
                    host_memory_bytes=_host_memory(),
                    layer_times=layer_times, layer_times_for=key, timed_workloads=more,
                    notes=f"aio {settings.aio.as_dict()}; SSD folder {nvme_path}"
                          + (f"; ZeRO-3 probe: the mean of {zero_terms['processes']} processes"
                             if "processes" in zero_terms else ""))


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
