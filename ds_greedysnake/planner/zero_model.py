"""ZeRO-Infinity's step as the planner models it (``horizontal_phases``): DeepSpeed 0.19.8's ZeRO-3 with
parameters and optimizer states on NVMe, per micro-batch every layer's swapped tensors read again, then its
optimizer step, serial. Each term was checked against a profile of the real engine at several shapes
(docs/planner.md, "The planner on shapes it never ran on"); ZeRO-3's own costs come from its probe
(``zero_probe.py``) when the hardware has them, else from the machine's rates.
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List

from .cost_model import Linear, Phase, Rates, Workload, layer_times, on_ssd
from .hardware import Hardware
from .shapes import LayerShape

if TYPE_CHECKING:  # the cost model stays free of torch and DeepSpeed, which settings.py imports
    from ..settings import Settings


@dataclass
class HorizontalSettings:
    """What of ds_config's ZeRO-3 section changes ZeRO-Infinity's traffic (``settings.ZeroSettings``)."""
    prefetch: bool = False         # stage3_prefetch_bucket_size > 0: reads overlap compute
    reuse_recompute_fetch: bool = False  # stage3_max_reuse_distance > 0: backward reuses the recompute's fetch
    recompute: bool = True         # blocks wrapped in activation checkpointing (a fair baseline; the A/B does)
    # What ZeRO-3 keeps on the device by its own rules (device_memory.py), DeepSpeed 0.19.8's defaults:
    prefetch_bucket_elements: float = 5e7     # stage3_prefetch_bucket_size: parameters fetched ahead
    persistence_threshold: float = 1e5        # stage3_param_persistence_threshold: smaller tensors stay resident
    max_live_parameters: float = 1e9          # stage3_max_live_parameters: gathered parameters at most
    reduce_bucket_elements: float = 5e8       # reduce_bucket_size: the gradient bucket
    # What its swappers put on NVMe: tensors (and optimizer sub-groups) of at least min_swap_bytes (DeepSpeed's
    # MIN_AIO_BYTES, 1 MiB, or the aio block if larger); the rest stays in host memory. The optimizer's unit
    # is a sub-group: parameter tensors in model order until sub_group_size elements.
    min_swap_bytes: float = float(1 << 20)
    sub_group_size: float = 1e9

    @classmethod
    def from_settings(cls, settings: "Settings", recompute: bool = True) -> "HorizontalSettings":
        zero = settings.zero
        return cls(prefetch=zero.prefetch_bucket_size > 0, reuse_recompute_fetch=zero.max_reuse_distance > 0,
                   recompute=recompute, prefetch_bucket_elements=zero.prefetch_bucket_size,
                   persistence_threshold=zero.param_persistence_threshold,
                   max_live_parameters=zero.max_live_parameters, reduce_bucket_elements=zero.reduce_bucket_size,
                   min_swap_bytes=zero.min_swap_bytes, sub_group_size=zero.sub_group_size)


def zero_swapped_tensors(layer: LayerShape, element_bytes: int, settings: HorizontalSettings) -> List[int]:
    """The element counts of ``layer``'s parameter tensors ZeRO-3 swaps to NVMe, one rank's partition each:
    above the persistence threshold and at least ``min_swap_bytes`` (``swappable_tensor``)."""
    partitions = [-(-numel // layer.partition_ranks) for numel in layer.tensor_numels
                  if numel > settings.persistence_threshold]
    return [numel for numel in partitions if numel * element_bytes >= settings.min_swap_bytes]


def zero_sub_groups(layers: List[LayerShape], settings: HorizontalSettings) -> List[List[int]]:
    """The optimizer's sub-groups as ZeRO-3 forms them (``_create_fp16_sub_groups``): each parameter
    tensor's partition in model order, a group closed once it holds ``sub_group_size`` elements."""
    groups, current = [], []
    for layer in layers:
        for numel in layer.tensor_numels:
            current.append(-(-numel // layer.partition_ranks))
            if sum(current) >= settings.sub_group_size:
                groups.append(current)
                current = []
    return groups + ([current] if current else [])


def zero_optimizer_seconds(workload: Workload, rates: Rates, settings: HorizontalSettings) -> Dict[str, Linear]:
    """ZeRO-3's optimizer step, one sub-group after another and each part after the other (stage3.py
    ``step``: swap in the fp32 partition, both moments and the gradient; Adam; the new weights, their swapped
    tensors written; swap out the three states): name -> seconds. A sub-group under ``min_swap_bytes`` stays
    in host memory (Adam alone). Each part at the seconds per element the ZeRO-3 probe measured when it did
    (``zero_optimizer_seconds_per_element``), else from the aio ops and CPU Adam's rate. Profiled on this
    machine at hidden 384, 640 and 768: the parts add up to the step, less 25-31 ms of other work, which the
    probe measures as "optimizer step, beyond its parts"."""
    element_bytes, measured = workload.param_bytes, rates.zero_per_element
    groups = zero_sub_groups(workload.shape.layers, settings)
    swapped_groups = [group for group in groups if 4 * sum(group) >= settings.min_swap_bytes]
    swapped, params = sum(sum(group) for group in swapped_groups), workload.shape.params
    parts = {"optimizer state read": Linear(), "Adam": Linear(params * rates.adam), "parameter write": Linear(),
             "optimizer state write": Linear()}
    for group in swapped_groups:
        states = 3 * rates.read_op(4 * sum(group))                      # fp32 weights, exp_avg, exp_avg_sq
        gradients = sum(rates.read_op(4 * part) for part in group)      # one file per parameter's gradient
        parts["optimizer state read"] += on_ssd("opt", states) + on_ssd("grad", gradients)
        parts["optimizer state write"] += on_ssd("opt", 3 * rates.write_op(4 * sum(group)))
        written = [part for part in group if part * element_bytes >= settings.min_swap_bytes]
        parts["parameter write"] += on_ssd("param", sum(rates.write_op(element_bytes * part) for part in written))
    elements = {"optimizer state read": swapped, "optimizer state write": swapped, "Adam": params,
                "parameter write": params, "optimizer step, beyond its parts": params}
    shares = {"optimizer state read": "opt", "optimizer state write": "opt", "parameter write": "param"}
    for part, count in elements.items():
        if part in measured:
            seconds = count * measured[part]
            parts[part] = on_ssd(shares[part], seconds) if part in shares else Linear(seconds)
    return parts


def zero_boundary_gradient_write(workload: Workload, rates: Rates, settings: HorizontalSettings) -> Linear:
    """The last micro-batch's backward writes every swapped sub-group's fp32 gradients to NVMe, one op per
    parameter (stage3.py ``_swap_out_offload_fp32_gradients``), before the optimizer step reads them back;
    at the ZeRO-3 probe's seconds per element when it measured them."""
    groups = [group for group in zero_sub_groups(workload.shape.layers, settings)
              if 4 * sum(group) >= settings.min_swap_bytes]
    part = "gradient write (boundary)"
    if part in rates.zero_per_element:
        return on_ssd("grad", sum(sum(group) for group in groups) * rates.zero_per_element[part])
    return on_ssd("grad", sum(rates.write_op(4 * numel) for group in groups for numel in group))


def zero_fetch_seconds(layer: LayerShape, workload: Workload, rates: Rates, settings: HorizontalSettings) -> float:
    """One fetch of ``layer`` by ZeRO-3's swapper: one aio op per swapped tensor, issued together and waited
    for (``swap_in`` with ``synchronize_reads``); with prefetch, at the deep-queue rate as a lane."""
    swapped = zero_swapped_tensors(layer, workload.param_bytes, settings)
    if settings.prefetch:
        return sum(swapped) * workload.param_bytes * rates.read
    return sum(rates.zero_param_read(workload.param_bytes * numel) for numel in swapped)


def horizontal_phases(workload: Workload, hardware: Hardware, settings: HorizontalSettings) -> List[Phase]:
    """Per micro-batch, per layer: forward and backward, each reading the layer's swapped tensors (a
    checkpointed block twice in backward, recompute and backward, unless the fetch is reused); reads
    are serial with compute without prefetch; where the device is the host, each micro-batch's gradient
    reduction (``zero_grad_reduce_elements_per_s``) adds to the backward's compute. The last micro-batch
    writes the swapped gradients (``zero_boundary_gradient_write``); then the optimizer step, serial
    (``zero_optimizer_seconds``)."""
    layers, times, rates = workload.shape.layers, layer_times(workload, hardware), Rates(hardware)
    m = workload.micro_batches
    phases = []
    for sweep in ("forward", "backward"):
        for index in (range(len(layers)) if sweep == "forward" else range(len(layers) - 1, -1, -1)):
            layer = layers[index]
            checkpointed = layer.checkpointed and settings.recompute
            fetches = 1
            if sweep == "backward" and checkpointed and not settings.reuse_recompute_fetch:
                fetches = 2
            read_seconds = on_ssd("param", fetches * zero_fetch_seconds(layer, workload, rates, settings))
            time = times[index]
            compute = time.forward_s if sweep == "forward" else (
                time.forward_backward_s if checkpointed else time.forward_backward_s - time.forward_s)
            compute += fetches * rates.zero_fetch_overhead
            if sweep == "backward":  # the device is the host: the micro-batch's gradient reduced in the compute lane
                compute += layer.params * rates.zero_reduce_per_micro_batch(m)
            if settings.prefetch:
                serial, lanes = Linear(), {"compute": Linear(compute), "SSD": read_seconds}
            else:
                serial, lanes = read_seconds, {"compute": Linear(compute)}
            link = fetches * workload.param_bytes * layer.params + workload.checkpoint_bytes
            if sweep == "backward":
                link += workload.param_bytes * layer.params  # the micro-batch's gradient, to host memory
                # From the second micro-batch on, ZeRO-3 adds it on the device to the accumulated one it
                # keeps in host memory (stage3.py partition_grads: copy in, add, copy back), in the
                # accumulation dtype (DeepSpeed's default: the compute dtype).
                link += 2 * workload.param_bytes * layer.params * (m - 1) / m
            rates.add_link(lanes, link)
            phases.append(Phase(f"{sweep}[{index}]", serial, lanes, repeat=m, serial_name="SSD read (no prefetch)"))
    phases.append(Phase("gradient write (boundary)", zero_boundary_gradient_write(workload, rates, settings), {},
                        serial_name="SSD write (gradients)"))
    optimizer = zero_optimizer_seconds(workload, rates, settings)
    phases.append(Phase("optimizer step", sum(optimizer.values(), Linear()), {}, serial_name="optimizer step (serial)"))
    return phases



def _fetches_per_micro_batch(layer: LayerShape, settings: HorizontalSettings) -> int:
    """Forward's fetch, and backward's: twice for a checkpointed block (recompute, then backward) unless
    the recompute's fetch is reused."""
    twice = layer.checkpointed and settings.recompute and not settings.reuse_recompute_fetch
    return 1 + (2 if twice else 1)


def zero_terms(workload: Workload, hardware: Hardware, settings: HorizontalSettings) -> Dict[str, float]:
    """The ZeRO-Infinity step's predicted seconds by part (every share on SSD), named as
    ``deepspeed_compat.profile_zero_step`` times them, to check each term against a profile of the real
    engine (scripts/bench/planner_accuracy.py); "parameter reads" is a count of aio ops."""
    layers, times, rates = workload.shape.layers, layer_times(workload, hardware), Rates(hardware)
    m, on_ssd_only = workload.micro_batches, {}
    compute = sum(time.forward_s + (time.forward_backward_s if layer.checkpointed and settings.recompute
                                    else time.forward_backward_s - time.forward_s)
                  for layer, time in zip(layers, times))
    terms = {
        "parameter read": m * sum(_fetches_per_micro_batch(layer, settings)
                                  * zero_fetch_seconds(layer, workload, rates, settings) for layer in layers),
        "parameter reads": float(m * sum(_fetches_per_micro_batch(layer, settings)
                                         * len(zero_swapped_tensors(layer, workload.param_bytes, settings))
                                         for layer in layers)),
        "compute": m * (compute + sum(_fetches_per_micro_batch(layer, settings) for layer in layers)
                        * rates.zero_fetch_overhead),
        "gradient reduction": m * workload.shape.params * rates.zero_reduce_per_micro_batch(m),
        "gradient write (boundary)": zero_boundary_gradient_write(workload, rates, settings).value(on_ssd_only)}
    terms.update({name: part.value(on_ssd_only)
                  for name, part in zero_optimizer_seconds(workload, rates, settings).items()})
    return terms
