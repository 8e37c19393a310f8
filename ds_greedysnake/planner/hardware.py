"""A machine's rates, as the planner needs them: from a JSON file or from the probe.

Every rate is a field with its unit in its name; a file must name every required field and say
where its numbers come from (``source``). Optional: per-layer compute times measured by the probe
for one model and micro-batch size, used instead of FLOP/s when they match the workload.
"""
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Optional

from .errors import PlannerError


@dataclass
class LayerTimes:
    """Measured seconds per micro-batch of one layer kind: forward without a graph, forward+backward."""
    forward_s: float
    forward_backward_s: float


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
    host_device_bytes_per_s: Optional[float] = None      # host<->device copies; None: the device is the host
    grad_handoff_elements_per_s: Optional[float] = None  # the engine's gradient hand-over (copy, fp64 norm)
    host_memory_bytes: Optional[float] = None            # default budget for the planner
    device_memory_bytes: Optional[float] = None
    notes: str = ""
    # Probe only: layer kind -> times, valid for ``layer_times_for`` (a workload key, see cost_model).
    layer_times: Dict[str, LayerTimes] = field(default_factory=dict)
    layer_times_for: str = ""

    def __post_init__(self):
        for name in ("ssd_read_bytes_per_s", "ssd_write_bytes_per_s", "adam_elements_per_s", "device_flops_per_s",
                     "ssd_read_bytes_per_s_single", "ssd_write_bytes_per_s_single", "host_device_bytes_per_s",
                     "grad_handoff_elements_per_s",
                     "host_memory_bytes",
                     "device_memory_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise PlannerError(f"hardware {self.name!r}: {name} must be a positive number, got {value!r}")
        if self.ssd_read_bytes_per_s_single is None:
            self.ssd_read_bytes_per_s_single = self.ssd_read_bytes_per_s
        if self.ssd_write_bytes_per_s_single is None:
            self.ssd_write_bytes_per_s_single = self.ssd_write_bytes_per_s

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


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
    except TypeError as error:
        raise PlannerError(f"{where}: layer_times entries need forward_s and forward_backward_s ({error})") from None
    return Hardware(**values)


def load_hardware(path: str) -> Hardware:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except OSError as error:
        raise PlannerError(f"cannot read hardware file {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise PlannerError(f"hardware file {path} is not valid JSON: {error}") from None
    return hardware_from_dict(data, where=f"hardware file {path}")


def save_hardware(hardware: Hardware, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(hardware.to_dict(), handle, indent=1)
