"""One training step as phases in which resources run concurrently and the slowest binds.

A phase is a layer's forward or backward sweep (over all M micro-batches, for the vertical
schedule; one micro-batch, repeated M times, for the horizontal one). Each phase has *lanes*, the
resources that work at the same time (device compute, the optimizer worker, the SSD, the host
link, a prefetch stream), and a *serial* part that overlaps nothing (a fetch that must wait). Its
time is ``serial + max(lanes)``; a step is the sum over phases (design doc, section 4).

Every time is a ``Linear`` expression in the placement shares, the fractions kept in host memory
instead of on SSD: ``act`` (layer-input checkpoints), ``param`` (low-precision parameters),
``opt`` (fp32 master and Adam moments) and ``grad`` (the fp32 gradient handed to the update).
``search.py`` minimises the sum over those shares with a linear programme; ``evaluate`` plugs fixed
shares in.

Three schedules:
* ``engine_phases``: what ds_greedysnake's engine does today (section "The engine, as modelled" in
  docs/planner.md): the optimizer worker reads, steps and writes one layer at a time, in order; a
  gradient not kept in host memory is written synchronously; the front ``deferred_layers`` updates
  run after the step's decision and the next forward waits for each before reading that layer.
* ``ideal_vertical_phases``: the paper's model: per layer, an alpha share of the optimizer work in
  forward and the rest in backward, every transfer overlapped.
* ``horizontal_phases``: ZeRO-Infinity: per micro-batch, every layer's swapped parameters read again
  (serially when ZeRO-3's prefetch is off), then an optimizer step after the last micro-batch.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .errors import PlannerError
from .hardware import Hardware, LayerTimes
from .shapes import GPTShape

SHARES = ("act", "param", "opt", "grad")
OPTIMIZER_BYTES_PER_PARAM = 12   # fp32 master, exp_avg, exp_avg_sq
GRAD_BYTES_PER_PARAM = 4         # the fp32 gradient accumulated over the step


class Linear:
    """``const + sum(coef[share] * share)``: a time or a byte count, linear in the host shares."""
    __slots__ = ("const", "coefs")

    def __init__(self, const: float = 0.0, coefs: Optional[Dict[str, float]] = None):
        self.const = float(const)
        self.coefs = dict(coefs or {})

    def __add__(self, other) -> "Linear":
        if not isinstance(other, Linear):
            other = Linear(other)
        coefs = dict(self.coefs)
        for key, value in other.coefs.items():
            coefs[key] = coefs.get(key, 0.0) + value
        return Linear(self.const + other.const, coefs)

    __radd__ = __add__

    def __mul__(self, factor: float) -> "Linear":
        return Linear(self.const * factor, {key: value * factor for key, value in self.coefs.items()})

    __rmul__ = __mul__

    def value(self, shares: Dict[str, float]) -> float:
        return self.const + sum(coef * shares.get(key, 0.0) for key, coef in self.coefs.items())


def on_ssd(share: str, num_bytes: float) -> Linear:
    """The part of ``num_bytes`` not kept in host memory: ``num_bytes * (1 - share)``."""
    return Linear(num_bytes, {share: -num_bytes})


def in_host(share: str, num_bytes: float) -> Linear:
    return Linear(0.0, {share: num_bytes})


@dataclass
class Workload:
    """What one rank trains per step."""
    shape: GPTShape
    micro_batch_size: int
    micro_batches: int
    param_bytes: int = 4        # the compute dtype: 4 fp32, 2 bf16
    activation_bytes: int = 4

    def __post_init__(self):
        for name in ("micro_batch_size", "micro_batches", "param_bytes", "activation_bytes"):
            if getattr(self, name) < 1:
                raise PlannerError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.shape.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_micro_batch * self.micro_batches

    @property
    def checkpoint_bytes(self) -> int:
        """One layer input of one micro-batch."""
        return self.tokens_per_micro_batch * self.shape.hidden * self.activation_bytes

    def compute_key(self) -> str:
        """What measured layer times depend on (not M): matched against ``Hardware.layer_times_for``."""
        s = self.shape
        return (f"hidden={s.hidden},heads={s.heads},vocab={s.vocab},seq_len={s.seq_len},mlp_ratio={s.mlp_ratio},"
                f"micro_batch_size={self.micro_batch_size},param_bytes={self.param_bytes}")


def layer_times(workload: Workload, hardware: Hardware) -> List[LayerTimes]:
    """Per layer, seconds per micro-batch: measured by the probe when it measured this workload,
    else FLOPs over the device's effective FLOP/s (backward twice the forward)."""
    measured = hardware.layer_times if hardware.layer_times_for == workload.compute_key() else {}
    times = []
    for layer in workload.shape.layers:
        if layer.kind in measured:
            times.append(measured[layer.kind])
        else:
            forward = layer.forward_flops_per_token * workload.tokens_per_micro_batch / hardware.device_flops_per_s
            times.append(LayerTimes(forward, 3 * forward))
    return times


@dataclass
class Phase:
    name: str
    serial: Linear
    lanes: Dict[str, Linear]
    repeat: int = 1   # the horizontal schedule runs the same phase once per micro-batch
    serial_name: str = "serial"  # what the serial part is, named when it binds

    def seconds(self, shares: Dict[str, float]) -> Tuple[float, str]:
        """(seconds, the lane that binds); the serial part counts as its own resource when it dominates."""
        values = {name: lane.value(shares) for name, lane in self.lanes.items()}
        binding = max(values, key=values.get) if values else self.serial_name
        serial = self.serial.value(shares)
        slowest = values.get(binding, 0.0)
        if serial > slowest:
            binding = self.serial_name
        return self.repeat * (serial + slowest), binding


@dataclass
class StepPrediction:
    engine: str
    seconds: float
    tokens_per_second: float
    binding: str                           # the resource binding the most time
    seconds_by_binding: Dict[str, float]   # step time attributed to the lane that bound each phase
    phases: List[Tuple[str, float, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"engine": self.engine, "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
                "binding": self.binding, "seconds_by_binding": self.seconds_by_binding,
                "phases": [{"phase": n, "seconds": s, "binding": b} for n, s, b in self.phases]}


def evaluate(engine: str, phases: List[Phase], workload: Workload, shares: Dict[str, float]) -> StepPrediction:
    total, by_binding, rows = 0.0, {}, []
    for phase in phases:
        seconds, binding = phase.seconds(shares)
        total += seconds
        by_binding[binding] = by_binding.get(binding, 0.0) + seconds
        rows.append((phase.name, seconds, binding))
    binding = max(by_binding, key=by_binding.get)
    return StepPrediction(engine, total, workload.tokens_per_step / total, binding, by_binding, rows)


# ----------------------------------------------------------------------------- shared per-layer terms


class _Rates:
    def __init__(self, hardware: Hardware):
        self.read = 1.0 / hardware.ssd_read_bytes_per_s             # deep queue (the engine's chunks)
        self.write = 1.0 / hardware.ssd_write_bytes_per_s
        self.read_one = 1.0 / hardware.ssd_read_bytes_per_s_single  # one op per transfer (ZeRO-3's swapper)
        self.write_one = 1.0 / hardware.ssd_write_bytes_per_s_single
        self.adam = 1.0 / hardware.adam_elements_per_s
        handoff = hardware.grad_handoff_elements_per_s
        self.handoff = 0.0 if handoff is None else 1.0 / handoff
        link = hardware.host_device_bytes_per_s
        self.link = None if link is None else 1.0 / link

    def ssd(self, reads: Linear, writes: Linear) -> Linear:
        return reads * self.read + writes * self.write

    def add_link(self, lanes: Dict[str, Linear], num_bytes: float) -> None:
        if self.link is not None:
            lanes["host link"] = Linear(num_bytes * self.link)


def _update(params: int, workload: Workload, rates: _Rates) -> Tuple[Linear, Linear, Linear]:
    """The engine's per-layer update, one after another in the worker: read states and gradient
    together, Adam, write states and the new weights together. Returns (worker seconds, SSD bytes
    read, SSD bytes written)."""
    reads = on_ssd("opt", OPTIMIZER_BYTES_PER_PARAM * params) + on_ssd("grad", GRAD_BYTES_PER_PARAM * params)
    writes = on_ssd("opt", OPTIMIZER_BYTES_PER_PARAM * params) + on_ssd("param", workload.param_bytes * params)
    seconds = reads * rates.read + Linear(params * rates.adam) + writes * rates.write
    return seconds, reads, writes


# ----------------------------------------------------------------------------- the engine as it is


@dataclass
class EngineSettings:
    """What of ds_config changes the engine's schedule."""
    overlap: bool = True     # greedysnake.optimizer_overlap
    clipping: bool = False   # gradient_clipping > 0: every update waits for the global norm (deferred)
    gradient_host_bytes: float = 1024 * 2**20  # greedysnake.gradient_host_memory_mb (the engine's default)

    @classmethod
    def from_ds_config(cls, ds_config: dict) -> "EngineSettings":
        block = ds_config.get("greedysnake") or {}
        # DeepSpeed 0.19.8 clips at 1.0 when gradient_clipping is absent (design doc, section 7).
        return cls(overlap=bool(block.get("optimizer_overlap", True)),
                   clipping=float(ds_config.get("gradient_clipping", 1.0) or 0.0) > 0,
                   gradient_host_bytes=float(block.get("gradient_host_memory_mb", 1024)) * 2**20)

    def shares(self, workload: Workload, checkpoint_host_bytes: float) -> Dict[str, float]:
        """The host shares this configuration gives: gradient slots from the last layer down while they
        fit (as the engine's arena assigns them), checkpoints up to their budget."""
        held, total = 0.0, 0.0
        for layer in reversed(workload.shape.layers):
            slot = -(-GRAD_BYTES_PER_PARAM * layer.params // 4096) * 4096
            if held + slot <= self.gradient_host_bytes and held == total:
                held += slot
            total += slot
        checkpoints = workload.micro_batches * (len(workload.shape.layers) - 1) * workload.checkpoint_bytes
        return {"grad": held / total, "act": min(1.0, checkpoint_host_bytes / checkpoints), "param": 0.0, "opt": 0.0}


class _EngineTerms:
    """Per-layer quantities of one workload on one machine, shared by the engine's phases."""

    def __init__(self, workload: Workload, hardware: Hardware, deferred: int, overlap: bool):
        self.workload, self.layers = workload, workload.shape.layers
        self.times, self.rates = layer_times(workload, hardware), _Rates(hardware)
        self.count, self.m = len(self.layers), workload.micro_batches
        self.deferred, self.overlap = deferred, overlap
        self.updates = [_update(layer.params, workload, self.rates) for layer in self.layers]
        self.param_read = [on_ssd("param", workload.param_bytes * layer.params) for layer in self.layers]
        self.checkpoints = self.m * workload.checkpoint_bytes   # one layer's inputs, all micro-batches

    def update_in_forward(self, index: int) -> bool:
        """Layer ``index`` is updated after the step's decision, into the next forward."""
        return self.overlap and index < self.deferred


def engine_phases(workload: Workload, hardware: Hardware, deferred_layers: int, overlap: bool = True) -> List[Phase]:
    count = len(workload.shape.layers)
    if not 0 <= deferred_layers <= count:
        raise PlannerError(f"deferred_layers must be between 0 and {count} (the layers), got {deferred_layers}")
    terms = _EngineTerms(workload, hardware, deferred_layers if overlap else count, overlap)
    phases = [_engine_forward(terms, index) for index in range(count - 1)]
    phases += [_engine_backward(terms, index) for index in range(count - 1, -1, -1)]
    if not overlap:
        serial = Linear()
        for seconds, _, _ in terms.updates:
            serial += seconds
        phases.append(Phase("optimizer", serial, {}, serial_name="optimizer step (not overlapped)"))
    return phases


def _engine_forward(terms: _EngineTerms, index: int) -> Phase:
    rates, following = terms.rates, index + 1
    serial = Linear()
    if index == 0 and terms.overlap:
        serial += terms.updates[0][0]  # the first forward waits for layer 0's update, submitted last
    if index == 0 or terms.update_in_forward(index):
        # Its prefetch had nothing to overlap (layer 0) or was skipped while its update ran.
        serial += terms.param_read[index] * rates.read
    spill = on_ssd("act", terms.checkpoints)
    lanes = {"compute": Linear(terms.m * terms.times[index].forward_s) + spill * rates.write}
    reads, writes = Linear(), spill
    if terms.update_in_forward(following):  # its update runs now; its read waits for it
        lanes["optimizer worker"] = terms.updates[following][0]
        reads, writes = reads + terms.updates[following][1], writes + terms.updates[following][2]
    else:
        lanes["prefetch"] = terms.param_read[following] * rates.read
        reads += terms.param_read[following]
    lanes["SSD"] = rates.ssd(reads, writes)
    rates.add_link(lanes, 2 * terms.checkpoints + terms.workload.param_bytes * terms.layers[index].params)
    return Phase(f"forward[{index}]", serial, lanes, serial_name="fetch wait (update, read)")


def _engine_backward(terms: _EngineTerms, index: int) -> Phase:
    rates, params = terms.rates, terms.layers[index].params
    flush = on_ssd("grad", GRAD_BYTES_PER_PARAM * params)  # the gradient not kept in host memory: a synchronous write
    spilled = on_ssd("act", terms.checkpoints) if index > 0 else Linear()
    # The training thread also hands the gradient over: a copy to host memory and its fp64 norm.
    lanes = {"compute": Linear(terms.m * terms.times[index].forward_backward_s + params * rates.handoff)
             + flush * rates.write + spilled * rates.read}
    reads, writes = spilled, flush
    if index > 0:
        lanes["prefetch"] = terms.param_read[index - 1] * rates.read
        reads += terms.param_read[index - 1]
    previous = index + 1  # updated during this layer's backward, after its own flush
    if terms.overlap and previous < terms.count and not terms.update_in_forward(previous):
        lanes["optimizer worker"] = terms.updates[previous][0]
        reads, writes = reads + terms.updates[previous][1], writes + terms.updates[previous][2]
    lanes["SSD"] = rates.ssd(reads, writes)
    rates.add_link(lanes, 2 * terms.checkpoints + (terms.workload.param_bytes + GRAD_BYTES_PER_PARAM) * params)
    # The last layer's prefetch was skipped if its update was deferred: it is read now, serially.
    waits = Linear()
    if index == terms.count - 1 and terms.update_in_forward(index):
        waits = terms.param_read[index] * rates.read
    return Phase(f"backward[{index}]", waits, lanes, serial_name="fetch wait (update, read)")


# ----------------------------------------------------------------------------- the paper's vertical model


def ideal_vertical_phases(workload: Workload, hardware: Hardware, alpha: float) -> List[Phase]:
    """Section 4 of the design: per layer and phase, compute, CPU Adam, host link and SSD overlap fully.
    The gradient goes to host memory (no SSD traffic); the alpha share of each layer's optimizer work
    runs in the next forward, the rest in backward."""
    if not 0.0 <= alpha <= 1.0:
        raise PlannerError(f"alpha must be between 0 and 1, got {alpha}")
    layers, times, rates = workload.shape.layers, layer_times(workload, hardware), _Rates(hardware)
    count, m = len(layers), workload.micro_batches
    checkpoints = m * workload.checkpoint_bytes
    phases = []
    for sweep, indices in (("forward", range(count - 1)), ("backward", range(count - 1, -1, -1))):
        for index in indices:
            params = layers[index].params
            share = alpha if sweep == "forward" else 1.0 - alpha
            optimizer_io = on_ssd("opt", OPTIMIZER_BYTES_PER_PARAM * params) * share
            new_weights = on_ssd("param", workload.param_bytes * params) * share
            reads = on_ssd("param", workload.param_bytes * params) + optimizer_io
            writes = optimizer_io + new_weights
            if sweep == "forward":
                writes += on_ssd("act", checkpoints)
                compute = m * times[index].forward_s
                link = checkpoints + workload.param_bytes * params
            else:
                reads += on_ssd("act", checkpoints) if index > 0 else Linear()
                compute = m * times[index].forward_backward_s
                link = checkpoints + (workload.param_bytes + GRAD_BYTES_PER_PARAM) * params
            lanes = {"compute": Linear(compute), "CPU Adam": Linear(share * params * rates.adam),
                     "SSD": rates.ssd(reads, writes)}
            rates.add_link(lanes, link)
            phases.append(Phase(f"{sweep}[{index}]", Linear(), lanes))
    return phases


# ----------------------------------------------------------------------------- ZeRO-Infinity


@dataclass
class HorizontalSettings:
    """What of ds_config's ZeRO-3 section changes ZeRO-Infinity's traffic."""
    prefetch: bool = False         # stage3_prefetch_bucket_size > 0: reads overlap compute
    reuse_recompute_fetch: bool = False  # stage3_max_reuse_distance > 0: backward reuses the recompute's fetch
    recompute: bool = True         # blocks wrapped in activation checkpointing (a fair baseline; the A/B does)

    @classmethod
    def from_ds_config(cls, ds_config: dict, recompute: bool = True) -> "HorizontalSettings":
        zero = ds_config.get("zero_optimization") or {}
        # DeepSpeed's defaults: prefetch bucket 5e7 elements, reuse distance 1e9.
        return cls(prefetch=float(zero.get("stage3_prefetch_bucket_size", 5e7)) > 0,
                   reuse_recompute_fetch=float(zero.get("stage3_max_reuse_distance", 1e9)) > 0, recompute=recompute)


def horizontal_phases(workload: Workload, hardware: Hardware, settings: HorizontalSettings) -> List[Phase]:
    """Per micro-batch, per layer: forward and backward, each reading the layer's swapped parameters
    (a checkpointed block twice in backward, recompute and backward, unless the fetch is reused); reads
    are serial with compute without prefetch. Then the optimizer step, after every micro-batch: per
    layer, read states and gradient, Adam, write states, gradient and weights, as the swapper does."""
    layers, times, rates = workload.shape.layers, layer_times(workload, hardware), _Rates(hardware)
    m = workload.micro_batches
    phases = []
    for sweep in ("forward", "backward"):
        for index in (range(len(layers)) if sweep == "forward" else range(len(layers) - 1, -1, -1)):
            layer = layers[index]
            checkpointed = layer.checkpointed and settings.recompute
            fetches = 1
            if sweep == "backward" and checkpointed and not settings.reuse_recompute_fetch:
                fetches = 2
            reads = on_ssd("param", fetches * workload.param_bytes * layer.swapped_params)
            time = times[index]
            compute = time.forward_s if sweep == "forward" else (
                time.forward_backward_s if checkpointed else time.forward_backward_s - time.forward_s)
            read_seconds = reads * (rates.read if settings.prefetch else rates.read_one)
            if settings.prefetch:
                serial, lanes = Linear(), {"compute": Linear(compute), "SSD": read_seconds}
            else:
                serial, lanes = read_seconds, {"compute": Linear(compute)}
            link = fetches * workload.param_bytes * layer.params + workload.checkpoint_bytes
            if sweep == "backward":
                link += workload.param_bytes * layer.params  # the micro-batch's gradient, to host memory
            rates.add_link(lanes, link)
            phases.append(Phase(f"{sweep}[{index}]", serial, lanes, repeat=m, serial_name="SSD read (no prefetch)"))
    for index, layer in enumerate(layers):
        states = OPTIMIZER_BYTES_PER_PARAM * layer.params
        grads = GRAD_BYTES_PER_PARAM * layer.params
        reads = on_ssd("opt", states) + on_ssd("grad", grads)
        writes = on_ssd("opt", states) + on_ssd("grad", grads) + on_ssd("param", workload.param_bytes * layer.params)
        lanes = {"SSD read": reads * rates.read_one, "SSD write": writes * rates.write_one,
                 "CPU Adam": Linear(layer.params * rates.adam)}
        phases.append(Phase(f"optimizer[{index}]", Linear(), lanes))
    return phases
