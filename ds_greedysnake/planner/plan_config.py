"""From a config's settings, a model shape and a machine to plans: what the CLI and ``"auto": true`` share."""
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..settings import Settings
from .cost_model import Workload
from .zero_model import HorizontalSettings
from .engine_model import EngineSettings
from .errors import PlannerError
from .hardware import Hardware
from .search import GIB, Plan, search
from .shapes import GPTShape

DEFAULT_MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class PlanRequest:
    shape: GPTShape
    hardware: Hardware
    host_memory_bytes: Optional[float] = None      # None: the hardware's host memory, halved
    micro_batches: Optional[Sequence[int]] = None  # None: powers of two up to 64 and the config's M
    modelled_shares: bool = False                  # let parameters / optimizer states sit in host memory
    ideal: bool = False                            # the paper's model instead of the engine as it is
    zero_recompute: bool = True                    # the ZeRO-Infinity baseline uses activation checkpointing


def workload_from_settings(settings: Settings, shape: GPTShape, micro_batches: Optional[int] = None) -> Workload:
    width = 2 if settings.bf16 else 4
    return Workload(shape, settings.micro_batch_size, micro_batches or settings.micro_batches, param_bytes=width,
                    activation_bytes=width)


def budget_bytes(request: PlanRequest) -> float:
    if request.host_memory_bytes is not None:
        if request.host_memory_bytes <= 0:
            raise PlannerError(f"--host-memory must be positive (GB), got {request.host_memory_bytes / GIB}")
        return request.host_memory_bytes
    if request.hardware.host_memory_bytes is None:
        raise PlannerError(f"hardware {request.hardware.name!r} has no host_memory_bytes: give --host-memory GB")
    return request.hardware.host_memory_bytes / 2


def plan_for_settings(settings: Settings, request: PlanRequest) -> List[Plan]:
    """Plans per M, the recommended one first (see search.search)."""
    workload = workload_from_settings(settings, request.shape)
    candidates = list(request.micro_batches or DEFAULT_MICRO_BATCHES)
    if request.micro_batches is None and workload.micro_batches not in candidates:
        candidates.append(workload.micro_batches)
    if any(m < 1 for m in candidates):
        raise PlannerError(f"micro-batch counts must be at least 1, got {sorted(candidates)}")
    zero_settings = HorizontalSettings.from_settings(settings, recompute=request.zero_recompute)
    return search(workload, request.hardware, budget_bytes(request), zero_settings,
                  candidates, engine=not request.ideal, modelled_shares=request.modelled_shares,
                  settings=EngineSettings.from_settings(settings))
