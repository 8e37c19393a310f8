"""Data parallelism on one machine, as the planner models it: W ranks (one device each) sharing the
machine's SSD, CPU and host memory.

Each rank owns 1/W of every layer's parameters and optimizer states (design doc, section 5): its SSD
bytes and Adam elements are 1/W of the model's, while the SSD array, the CPU Adam rate and host memory
are the machine's, shared by the W ranks working at once (each rank sees 1/W of each rate and of the
host budget). Compute, the device and its host link are each rank's own. A rank's step is then the
one-rank model on the sharded shape and the per-rank machine, plus what the collectives add to its
host link (PCIe: no NVLink assumed): the all-gather of each fetched layer ((W-1)/W of its bytes arrive
from the other ranks) and the reduce-scatter of each gradient ((W-1)/W of it, in the dtype reduced:
fp32 for greedysnake's accumulator, once per step; the compute dtype for ZeRO-3, per micro-batch).
"""
import dataclasses
import re
from typing import List

from .cost_model import GRAD_BYTES_PER_PARAM, Linear, Phase, Workload
from .zero_model import HorizontalSettings
from .errors import PlannerError
from .hardware import Hardware
from .shapes import GPTShape

_PHASE = re.compile(r"(forward|backward)\[(\d+)\]$")


def check_ranks(ranks: int) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise PlannerError(f"ranks must be a positive integer (data-parallel devices), got {ranks!r}")


def sharded_shape(shape: GPTShape, ranks: int) -> GPTShape:
    """The shape one rank stores and updates: every layer's parameters divided by ``ranks`` (rounded up);
    FLOPs, activations and tensor sizes stay those of the whole layer."""
    check_ranks(ranks)
    if ranks == 1:
        return shape
    copy = GPTShape(f"{shape.name} (1/{ranks} per rank)", shape.num_blocks, shape.hidden, shape.heads, shape.vocab,
                    shape.seq_len, shape.mlp_ratio, shape.notes)
    layers = [dataclasses.replace(layer, params=-(-layer.params // ranks),
                                  swapped_params=-(-layer.swapped_params // ranks), partition_ranks=ranks)
              for layer in shape.layers]
    object.__setattr__(copy, "layers", layers)  # frozen: the per-rank layers replace the computed ones
    return copy


def per_rank_hardware(hardware: Hardware, ranks: int) -> Hardware:
    """The machine as one of ``ranks`` ranks sees it: the SSD's rates, CPU Adam and the worker's update
    cost shared (1/W each), host memory shared; the device, its link and its FLOP/s its own."""
    check_ranks(ranks)
    if ranks == 1:
        return hardware
    scaled = {name: getattr(hardware, name) / ranks for name in (
        "ssd_read_bytes_per_s", "ssd_write_bytes_per_s", "ssd_read_bytes_per_s_single", "ssd_write_bytes_per_s_single",
        "adam_elements_per_s")}
    for name in ("update_seconds_per_element", "update_state_io_seconds_per_element"):
        if getattr(hardware, name) is not None:
            scaled[name] = getattr(hardware, name) * ranks
    if hardware.host_memory_bytes is not None:
        scaled["host_memory_bytes"] = hardware.host_memory_bytes / ranks
    return dataclasses.replace(hardware, name=f"{hardware.name} (one of {ranks} ranks)", **scaled)


def add_collectives(phases: List[Phase], shape: GPTShape, workload: Workload, hardware: Hardware, ranks: int,
                    engine: str, zero_settings: HorizontalSettings = HorizontalSettings()) -> None:
    """Add each rank's collective bytes to the host-link lanes of ``phases`` (``shape``: the whole model;
    ``engine``: "greedysnake" or "zero_infinity"). Nothing without a link or with one rank."""
    if ranks == 1 or hardware.host_device_bytes_per_s is None:
        return
    others = (ranks - 1) / ranks
    for phase in phases:
        match = _PHASE.match(phase.name)
        if not match or "host link" not in phase.lanes:
            continue
        sweep, index = match.group(1), int(match.group(2))
        layer = shape.layers[index]
        fetches = 1
        if engine == "zero_infinity" and sweep == "backward" and layer.checkpointed and zero_settings.recompute \
                and not zero_settings.reuse_recompute_fetch:
            fetches = 2
        gathered = fetches * workload.param_bytes * layer.params
        if engine == "greedysnake" and sweep == "backward" and index == len(shape.layers) - 2:
            gathered = 0  # still resident from forward
        reduced = 0
        if sweep == "backward":
            reduced = (GRAD_BYTES_PER_PARAM if engine == "greedysnake" else workload.param_bytes) * layer.params
        phase.lanes["host link"] = phase.lanes["host link"] + Linear(
            others * (gathered + reduced) / hardware.host_device_bytes_per_s)
