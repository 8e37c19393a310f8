"""A machine's rates, as the planner needs them: from a JSON file or from the probe.

Every rate is a field with its unit in its name; a file must name every required field and say
where its numbers come from (``source``). Optional: per-layer compute times measured by the probe
for one model and micro-batch size, used instead of FLOP/s when they match the workload.
"""
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Dict, Optional

from .errors import PlannerError


@dataclass
class LayerTimes:
    """Measured seconds per micro-batch of one layer kind: forward without a graph, forward+backward."""
    forward_s: float
    forward_backward_s: float


@dataclass
class WorkloadTimes:
    """What the probe measured for one more workload (a micro-batch size of a sweep): its layers'
    times and the shared-cores slow-down, both of which depend on the tokens per micro-batch."""
    layer_times: Dict[str, LayerTimes]
    compute_slowdown_sharing_cores: Optional[float] = None
    engine_threads_slowdown: Optional[float] = None


# Where a hardware file's number may come from: the paper (arXiv 2512.17570, as restated in the design
# notes), a vendor's data sheet, a measurement (the probe, on the machine it names), or an assumption.
ASSUMPTION_SOURCES = ("paper", "vendor sheet", "measured", "assumed")


@dataclass
class Hardware:
    name: str
    source: str
    ssd_read_bytes_per_s: float          # deep queue: a transfer split in chunks issued together (the engine)
    ssd_write_bytes_per_s: float         # deep queue, as above
    adam_elements_per_s: float           # CPU Adam over fp32 master, moments and gradient
    device_flops_per_s: float            # effective FLOP/s of a layer's compute at the micro-batch size
    ssd_read_bytes_per_s_single: Optional[float] = None  # one op per transfer (ZeRO-3's swapper); default: deep
    ssd_write_bytes_per_s_single: Optional[float] = None  # one op per transfer; default: deep
    # ZeRO-3's swappers' aio ops, one at a time into locked buffers: bytes -> median seconds, probed at the model's
    # own op sizes (probe.probe_zero_ops; cost_model.op_seconds interpolates). Empty: bytes / rate_single.
    ssd_read_seconds_by_op_size: Dict[int, float] = field(default_factory=dict)
    ssd_write_seconds_by_op_size: Dict[int, float] = field(default_factory=dict)
    # ZeRO-3 itself, measured on four blocks of the model (planner/zero_probe.py; None: not modelled): what its
    # forwards and backwards take per layer fetch beyond the plain compute and the reads (hooks, gathers,
    # releases), and its Adam, one call per optimizer sub-group, in elements/s.
    zero_seconds_per_fetch: Optional[float] = None
    # Its parameter swapper's reads (swap_in: the aio op into its locked buffer and its own work), bytes ->
    # median seconds, at the sizes the model reads.
    zero_read_seconds_by_size: Dict[int, float] = field(default_factory=dict)
    # Its optimizer step's parts and the boundary's gradient write, seconds per element each works on
    # (zero_probe.optimizer_elements names the parts and their elements).
    zero_optimizer_seconds_per_element: Dict[str, float] = field(default_factory=dict)
    host_device_bytes_per_s: Optional[float] = None      # host<->device copies; None: the device is the host
    grad_handoff_elements_per_s: Optional[float] = None  # the engine's gradient hand-over (copy, fp64 norm)
    # ZeRO-3's gradient reduction of every micro-batch where the device is the host (no link lane carries
    # it): flatten the bucket, reduce-scatter it (a copy at one rank), add it into the fp32 partition;
    # elements/s, in the compute lane. None: not modelled (a GPU's link lane carries its copy and add).
    zero_grad_reduce_elements_per_s: Optional[float] = None
    host_memory_bytes: Optional[float] = None            # default budget for the planner
    device_memory_bytes: Optional[float] = None
    # What the device needs beyond the model's tensors (CUDA context, library workspaces, the allocator's
    # fragmentation): subtracted from device_memory_bytes by the micro-batch search. None: 0.
    device_workspace_bytes: Optional[float] = None
    # Whether the attention kernel keeps the heads x seq x seq scores for backward (a plain softmax
    # attention); False for a fused (flash) kernel such as scaled_dot_product_attention's on an A100.
    device_attention_keeps_scores: bool = False
    # How the engine's transfers and its optimizer worker behave beyond the rates (the probe measures
    # them; absent in a file: no fixed cost, updates from the rates, no slow-down). A transfer through the engine's SsdStore costs
    # ``seconds_per_transfer + bytes / rate``: at the engine's layer-sized transfers the fixed part is
    # several ms here (one aio thread works through a transfer's chunks in turn).
    ssd_read_seconds_per_transfer: Optional[float] = None
    ssd_write_seconds_per_transfer: Optional[float] = None
    # A layer update as the engine's worker runs it, per parameter: with its states in host memory (Adam,
    # the cast, the new weights written), and what states going through SSD add (read, then write).
    update_seconds_per_element: Optional[float] = None
    update_state_io_seconds_per_element: Optional[float] = None
    # Training compute while the optimizer worker shares its cores (the CPU accelerator): seconds with
    # one thread fewer over seconds with all of them; 1 when the device computes apart from the host.
    compute_slowdown_sharing_cores: Optional[float] = None
    # The greedysnake engine's compute at its training threads (config.training_threads_for: on the CPU
    # accelerator the cores less the worker's) over the layer times, which are timed at torch's threads as
    # ZeRO-3 runs them; 1 (None) with a GPU.
    engine_threads_slowdown: Optional[float] = None
    notes: str = ""
    # Where each number comes from: field (or "model.<what>") -> {"source": one of ASSUMPTION_SOURCES,
    # "note": why this value}. Shown by scripts/bench/plan_projection.py; checked by the unit tests.
    assumptions: Dict[str, Dict[str, str]] = field(default_factory=dict)
    # Probe only: layer kind -> times, valid for ``layer_times_for`` (a workload key, see cost_model).
    layer_times: Dict[str, LayerTimes] = field(default_factory=dict)
    layer_times_for: str = ""
    # Probe only: further workloads it timed (compute key -> WorkloadTimes), for ``plan --saturated``'s
    # sweep over micro-batch sizes; ``for_workload`` picks the one a prediction needs.
    timed_workloads: Dict[str, WorkloadTimes] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("ssd_read_bytes_per_s", "ssd_write_bytes_per_s", "adam_elements_per_s", "device_flops_per_s",
                     "ssd_read_bytes_per_s_single", "ssd_write_bytes_per_s_single", "host_device_bytes_per_s",
                     "grad_handoff_elements_per_s", "zero_grad_reduce_elements_per_s",
                     "host_memory_bytes",
                     "device_memory_bytes", "device_workspace_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise PlannerError(f"hardware {self.name!r}: {name} must be a positive number, got {value!r}")
        if self.ssd_read_bytes_per_s_single is None:
            self.ssd_read_bytes_per_s_single = self.ssd_read_bytes_per_s
        if self.ssd_write_bytes_per_s_single is None:
            self.ssd_write_bytes_per_s_single = self.ssd_write_bytes_per_s
        for name in ("ssd_read_seconds_per_transfer", "ssd_write_seconds_per_transfer", "update_seconds_per_element",
                     "update_state_io_seconds_per_element", "zero_seconds_per_fetch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise PlannerError(f"hardware {self.name!r}: {name} must be a number >= 0, got {value!r}")
        if not isinstance(self.device_attention_keeps_scores, bool):
            raise PlannerError(f"hardware {self.name!r}: device_attention_keeps_scores must be true or false, "
                               f"got {self.device_attention_keeps_scores!r}")
        for name in ("ssd_read_seconds_by_op_size", "ssd_write_seconds_by_op_size", "zero_read_seconds_by_size"):
            table = getattr(self, name)
            if not isinstance(table, dict) or any(
                    isinstance(size, bool) or not isinstance(size, int) or size <= 0 or isinstance(seconds, bool)
                    or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0
                    for size, seconds in table.items()):
                raise PlannerError(f"hardware {self.name!r}: {name} must map op sizes in bytes (positive integers) "
                                   f"to seconds (positive numbers), got {table!r}")
        parts = self.zero_optimizer_seconds_per_element
        if not isinstance(parts, dict) or any(
                not isinstance(part, str) or isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                or not math.isfinite(seconds) or seconds < 0 for part, seconds in parts.items()):
            raise PlannerError(f"hardware {self.name!r}: zero_optimizer_seconds_per_element must map part names to "
                               f"seconds per element (numbers >= 0), got {parts!r}")
        for key, entry in self.assumptions.items():
            if not isinstance(entry, dict) or entry.get("source") not in ASSUMPTION_SOURCES:
                raise PlannerError(f"hardware {self.name!r}: assumptions[{key!r}] must be an object with \"source\" "
                                   f"one of {', '.join(ASSUMPTION_SOURCES)} and a \"note\", got {entry!r}")
        for name in ("compute_slowdown_sharing_cores", "engine_threads_slowdown"):
            slowdown = getattr(self, name)
            if slowdown is not None and (isinstance(slowdown, bool) or not isinstance(slowdown, (int, float))
                                         or not math.isfinite(slowdown) or slowdown < 1):
                raise PlannerError(f"hardware {self.name!r}: {name} must be a number >= 1 (1: no slow-down), "
                                   f"got {slowdown!r}")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def for_workload(self, compute_key: str) -> "Hardware":
        """This machine with the layer times and the shared-cores slow-down the probe measured for
        ``compute_key`` (``Workload.compute_key``) when it timed that workload as one more; else itself."""
        timed = self.timed_workloads.get(compute_key)
        if timed is None or compute_key == self.layer_times_for:
            return self
        return replace(self, layer_times=dict(timed.layer_times), layer_times_for=compute_key,
                       compute_slowdown_sharing_cores=timed.compute_slowdown_sharing_cores,
                       engine_threads_slowdown=timed.engine_threads_slowdown)

    @property
    def timed_keys(self):
        """Every workload whose layers the probe timed."""
        return ([self.layer_times_for] if self.layer_times else []) + sorted(self.timed_workloads)


REQUIRED_FIELDS = ("name", "source", "ssd_read_bytes_per_s", "ssd_write_bytes_per_s", "adam_elements_per_s",
                   "device_flops_per_s")


def hardware_from_dict(data: Dict[str, Any], where: str = "hardware") -> Hardware:
    if not isinstance(data, dict):
        raise PlannerError(f"{where}: expected a JSON object with fields {', '.join(REQUIRED_FIELDS)}")
    missing = [name for name in REQUIRED_FIELDS if name not in data]
    if missing:
        raise PlannerError(f"{where} is missing the field(s) {', '.join(missing)} (required: "
                           f"{', '.join(REQUIRED_FIELDS)}; rates in bytes/s, elements/s, FLOP/s)")
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlannerError(f"{where} has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values = dict(data)
    try:
        values["layer_times"] = {kind: LayerTimes(**times) for kind, times in (data.get("layer_times") or {}).items()}
        values["timed_workloads"] = {
            key: WorkloadTimes({kind: LayerTimes(**times) for kind, times in (entry.get("layer_times") or {}).items()},
                               entry.get("compute_slowdown_sharing_cores"), entry.get("engine_threads_slowdown"))
            for key, entry in (data.get("timed_workloads") or {}).items()}
        for name in ("ssd_read_seconds_by_op_size", "ssd_write_seconds_by_op_size",
                     "zero_read_seconds_by_size"):  # JSON keys are strings
            values[name] = {int(size): seconds for size, seconds in (data.get(name) or {}).items()}
    except ValueError:
        raise PlannerError(f"{where}: the keys of ssd_*_seconds_by_op_size and zero_read_seconds_by_size must be "
                           "op sizes in bytes (integers)") from None
    except (TypeError, AttributeError) as error:
        raise PlannerError(f"{where}: layer_times entries need forward_s and forward_backward_s, timed_workloads "
                           f"entries layer_times and compute_slowdown_sharing_cores ({error})") from None
    return Hardware(**values)


def read_json(path: str, what: str):
    """The JSON in ``path``; ``what`` names the file in the error (a PlannerError) if it cannot be read."""
    try:
        with open(path) as handle:
            return json.load(handle)
    except OSError as error:
        raise PlannerError(f"cannot read {what} {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise PlannerError(f"{what} {path} is not valid JSON: {error}") from None


def load_hardware(path: str) -> Hardware:
    return hardware_from_dict(read_json(path, "hardware file"), where=f"hardware file {path}")


def save_hardware(hardware: Hardware, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(hardware.to_dict(), handle, indent=1)
