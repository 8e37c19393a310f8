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
* ``engine_phases`` (in ``engine_model.py``): what ds_greedysnake's engine does today (section "The
  engine, as modelled" in docs/planner.md); its step is evaluated as a timeline of the phases beside the
  optimizer worker's queue (``worker_queue.py``), not as their sum.
* ``ideal_vertical_phases``: the paper's model: per layer, an alpha share of the optimizer work in
  forward and the rest in backward, every transfer overlapped.
* ``horizontal_phases`` (in ``zero_model.py``): ZeRO-Infinity: per micro-batch, every layer's swapped
  tensors read again (serially when ZeRO-3's prefetch is off), then its optimizer step, serial.
"""
import bisect
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

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


def compute_key_fields(key: str) -> Dict[str, str]:
    """``Workload.compute_key``'s fields, by name."""
    return dict(item.split("=", 1) for item in key.split(",") if "=" in item)


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
    # How the phase meets ds_greedysnake's optimizer worker (``worker_queue.QueueLink``); with it on every
    # phase, ``evaluate`` runs the step as a timeline of the phases beside the worker's queue.
    queue: Optional[object] = None

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
    """The step: the sum of the phases, or, where every phase says how it meets the optimizer worker's queue,
    their timeline beside it (``worker_queue``)."""
    if phases and all(phase.queue is not None for phase in phases):
        from .worker_queue import timeline_seconds
        total, rows = timeline_seconds(phases, shares)
    else:
        rows = [(phase.name, *phase.seconds(shares)) for phase in phases]
        total = sum(seconds for _, seconds, _ in rows)
    by_binding = {}
    for _, seconds, binding in rows:
        by_binding[binding] = by_binding.get(binding, 0.0) + seconds
    binding = max(by_binding, key=by_binding.get)
    return StepPrediction(engine, total, workload.tokens_per_step / total, binding, by_binding, rows)


# ----------------------------------------------------------------------------- shared per-layer terms


def op_seconds(by_size: Dict[int, float], bytes_per_s: float) -> Callable[[float], float]:
    """Seconds of one aio op of ``num_bytes``: linear between the sizes ``by_size`` timed, each size's time
    scaled by size below the smallest and at the largest one's rate above it; ``num_bytes / bytes_per_s``
    without a table."""
    sizes = sorted(by_size)

    def seconds(num_bytes: float) -> float:
        if not sizes:
            return num_bytes / bytes_per_s
        if num_bytes <= sizes[0] or num_bytes >= sizes[-1]:
            edge = sizes[0] if num_bytes <= sizes[0] else sizes[-1]
            return by_size[edge] * num_bytes / edge
        upper = bisect.bisect_left(sizes, num_bytes)
        low, high = sizes[upper - 1], sizes[upper]
        return by_size[low] + (by_size[high] - by_size[low]) * (num_bytes - low) / (high - low)

    return seconds


def zero_reduce_seconds_per_element(reduce_s: float, boundary_s: float, micro_batches: int) -> float:
    """ZeRO-3's reduction per element of a micro-batch, averaged over M: M-1 at ``reduce_s``, the last (the
    boundary, which also hands the gradients to the optimizer) at ``boundary_s``."""
    return ((micro_batches - 1) * reduce_s + boundary_s) / micro_batches


class Rates:
    """Seconds per byte / element of a machine, and the engine's per-transfer and per-update costs."""

    def __init__(self, hardware: Hardware):
        self.read = 1.0 / hardware.ssd_read_bytes_per_s             # deep queue (the engine's chunks)
        self.write = 1.0 / hardware.ssd_write_bytes_per_s
        self.read_one = 1.0 / hardware.ssd_read_bytes_per_s_single  # one op per transfer (ZeRO-3's swapper)
        self.write_one = 1.0 / hardware.ssd_write_bytes_per_s_single
        # ZeRO-3's swappers' aio ops at the sizes the probe timed (else at the one-op rates), and its parameter
        # reads as the ZeRO-3 probe timed them (its aio op and the swapper's own work), else the aio op alone.
        self.read_op = op_seconds(hardware.ssd_read_seconds_by_op_size, hardware.ssd_read_bytes_per_s_single)
        self.write_op = op_seconds(hardware.ssd_write_seconds_by_op_size, hardware.ssd_write_bytes_per_s_single)
        self.zero_param_read = (op_seconds(hardware.zero_read_seconds_by_size, hardware.ssd_read_bytes_per_s_single)
                                if hardware.zero_read_seconds_by_size else self.read_op)
        # ZeRO-3's own costs (planner/zero_probe.py): per layer fetch beyond compute and reads; its Adam.
        self.zero_fetch_overhead = hardware.zero_seconds_per_fetch or 0.0
        self.zero_per_element = dict(hardware.zero_optimizer_seconds_per_element)
        self.read_latency = hardware.ssd_read_seconds_per_transfer or 0.0
        self.write_latency = hardware.ssd_write_seconds_per_transfer or 0.0
        self.update_host = hardware.update_seconds_per_element          # None: from the rates
        self.update_state_io = hardware.update_state_io_seconds_per_element
        # While the worker runs, the training compute loses this share of the worker's time (see engine_model).
        self.slowdown = hardware.compute_slowdown_sharing_cores or 1.0
        self.sharing = 1.0 - 1.0 / self.slowdown
        self.adam = 1.0 / hardware.adam_elements_per_s
        handoff = hardware.grad_handoff_elements_per_s
        self.handoff = 0.0 if handoff is None else 1.0 / handoff
        zero_reduce = hardware.zero_grad_reduce_elements_per_s if hardware.host_device_bytes_per_s is None else None
        self.zero_grad_reduce = 0.0 if zero_reduce is None else 1.0 / zero_reduce
        link = hardware.host_device_bytes_per_s
        self.link = None if link is None else 1.0 / link

    def zero_reduce_per_micro_batch(self, micro_batches: int) -> float:
        """Seconds per element of ZeRO-3's gradient reduction, averaged over a step's micro-batches: the
        last one's at its own cost when the ZeRO-3 probe measured it (it also hands the gradients over)."""
        boundary = self.zero_per_element.get("gradient reduction (boundary)")
        if boundary is None or not self.zero_grad_reduce:  # with a GPU the link lane carries the reduction
            return self.zero_grad_reduce
        return zero_reduce_seconds_per_element(self.zero_grad_reduce, boundary, micro_batches)

    def ssd(self, reads: Linear, writes: Linear) -> Linear:
        return reads * self.read + writes * self.write

    def read_seconds(self, share: str, num_bytes: float) -> Linear:
        """One engine read of ``num_bytes`` (its share kept in host memory is not read)."""
        return on_ssd(share, num_bytes) * self.read + on_ssd(share, self.read_latency)

    def write_seconds(self, share: str, num_bytes: float) -> Linear:
        return on_ssd(share, num_bytes) * self.write + on_ssd(share, self.write_latency)

    def add_link(self, lanes: Dict[str, Linear], num_bytes: float) -> None:
        if self.link is not None:
            lanes["host link"] = Linear(num_bytes * self.link)


# ----------------------------------------------------------------------------- the paper's vertical model


def ideal_vertical_phases(workload: Workload, hardware: Hardware, alpha: float) -> List[Phase]:
    """Section 4 of the design: per layer and phase, compute, CPU Adam, host link and SSD overlap fully.
    The gradient goes to host memory (no SSD traffic); the alpha share of each layer's optimizer work
    runs in the next forward, the rest in backward."""
    if not 0.0 <= alpha <= 1.0:
        raise PlannerError(f"alpha must be between 0 and 1, got {alpha}")
    layers, times, rates = workload.shape.layers, layer_times(workload, hardware), Rates(hardware)
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
