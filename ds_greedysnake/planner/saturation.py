"""Saturated throughput, the paper's measure: each engine's tokens/s as the global batch grows, over
every micro-batch size and M that fit the device, and where it stops growing.

For each engine and each (micro-batch size, M) whose device memory fits (``device_memory.py``), the
step is predicted (greedysnake: the search's best split and placement under the host budget;
ZeRO-Infinity: its horizontal model with the config's ZeRO-3 settings). The *curve* is the best
tokens/s at each global batch (micro-batch size x M x ranks); the *plateau* is its highest point over
the sweep; the *saturation point* is the smallest global batch within ``knee`` (95%) of the plateau.
The ratio of two engines' saturated throughputs is the ratio of their plateaus. ``saturation_of``
reduces measured points (``scripts/bench/saturation_accuracy.py``) the same way.
"""
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .cost_model import Workload, evaluate
from .data_parallel import add_collectives, check_ranks, per_rank_hardware, sharded_shape
from .device_memory import DeviceBytes, fits, greedysnake_device_bytes, zero_infinity_device_bytes
from .engine_model import EngineSettings
from .errors import PlannerError
from .hardware import Hardware
from .search import BudgetTooSmall, best_plan_for
from .shapes import GPTShape
from .zero_model import HorizontalSettings, horizontal_phases
from ..runtime.schedule import default_deferred_layers

KNEE = 0.95
DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_SWEEP_MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ENGINES = ("greedysnake", "zero_infinity")


@dataclass
class SweepPoint:
    """One configuration of one engine and its predicted (or measured) step."""
    engine: str
    micro_batch_size: int
    micro_batches: int
    ranks: int
    tokens_per_second: float
    seconds: float
    binding: str = ""
    device: Optional[DeviceBytes] = None

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.ranks

    def to_dict(self) -> dict:
        return {"engine": self.engine, "micro_batch_size": self.micro_batch_size, "micro_batches": self.micro_batches,
                "ranks": self.ranks, "global_batch": self.global_batch, "tokens_per_second": self.tokens_per_second,
                "seconds": self.seconds, "binding": self.binding,
                "device_bytes": None if self.device is None else self.device.to_dict()}


@dataclass
class Saturation:
    engine: str
    points: List[SweepPoint]                      # every configuration that fits
    knee: float = KNEE
    refused: List[Tuple[int, int, str]] = field(default_factory=list)  # (micro-batch size, M, why)

    def __post_init__(self):
        if not self.points:
            raise PlannerError(f"{self.engine}: no configuration of the sweep fits "
                               f"({'; '.join(f'micro-batch {s} x M={m}: {why}' for s, m, why in self.refused[:3])})")
        self.curve, self.plateau, self.saturation_point = saturation_of(self.points, self.knee)

    def to_dict(self) -> dict:
        return {"engine": self.engine, "knee": self.knee, "plateau": self.plateau.to_dict(),
                "saturation_point": self.saturation_point.to_dict(), "curve": [p.to_dict() for p in self.curve],
                "points": [p.to_dict() for p in self.points],
                "refused": [{"micro_batch_size": s, "micro_batches": m, "why": why} for s, m, why in self.refused]}


def saturation_of(points: Sequence[SweepPoint], knee: float = KNEE) -> Tuple[List[SweepPoint], SweepPoint, SweepPoint]:
    """(curve: the best point per global batch, ascending; plateau: the best point; saturation point:
    the smallest global batch whose best point is within ``knee`` of the plateau)."""
    best = {}
    for point in points:
        held = best.get(point.global_batch)
        if held is None or point.tokens_per_second > held.tokens_per_second:
            best[point.global_batch] = point
    curve = [best[batch] for batch in sorted(best)]
    plateau = max(curve, key=lambda point: point.tokens_per_second)
    saturation_point = next(point for point in curve if point.tokens_per_second >= knee * plateau.tokens_per_second)
    return curve, plateau, saturation_point


@dataclass
class SweepRequest:
    """What the sweep covers; the defaults are the paper-style sweep (powers of two)."""
    shape: GPTShape
    hardware: Hardware
    host_budget_bytes: float                       # the machine's budget for greedysnake (shared by the ranks)
    zero_settings: HorizontalSettings = field(default_factory=HorizontalSettings)
    engine_settings: EngineSettings = field(default_factory=EngineSettings)
    micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCH_SIZES
    micro_batches: Sequence[int] = DEFAULT_SWEEP_MICRO_BATCHES
    ranks: int = 1
    dtype_bytes: int = 2                           # the compute dtype: 2 bf16, 4 fp32
    ideal: bool = False                            # greedysnake's paper model instead of the engine as it runs
    splits: Optional[Iterable] = None              # greedysnake's splits to try (None: sweep_splits)
    prefetch_depth: int = 1                        # greedysnake.prefetch_depth (device buffers)
    engines: Sequence[str] = ENGINES               # which engines to sweep

    def __post_init__(self):
        check_ranks(self.ranks)
        unknown = sorted(set(self.engines) - set(ENGINES))
        if unknown or not self.engines:
            raise PlannerError(f"the sweep's engines must be among {', '.join(ENGINES)}, got {list(self.engines)}")
        for name in ("micro_batch_sizes", "micro_batches"):
            values = list(getattr(self, name))
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise PlannerError(f"the sweep's {name.replace('_', ' ')} must be positive integers, got {values}")


def sweep_splits(num_layers: int, ideal: bool) -> List:
    """The splits the sweep tries: fewer than the search's (``default_deferred_candidates``), so that a
    sweep of some 60 configurations stays within seconds. On the paper's settings the plateau moved by
    under 0.3% against the full set (docs/planner.md)."""
    if ideal:
        return [0.0, 0.25, 0.5, 0.75, 1.0]
    return list(dict.fromkeys([default_deferred_layers(num_layers), 0, num_layers // 2, num_layers]))


def sweep(request: SweepRequest) -> Dict[str, Saturation]:
    """engine -> its saturation over every configuration that fits ("greedysnake", "zero_infinity")."""
    shape, ranks = request.shape, request.ranks
    rank_shape = sharded_shape(shape, ranks)
    budget = request.host_budget_bytes / ranks
    found = {engine: [] for engine in request.engines}
    refused = {engine: [] for engine in request.engines}
    for size in sorted(set(request.micro_batch_sizes)):
        # The layer times the probe measured at this micro-batch size, when it timed it.
        key = Workload(shape, size, 1, request.dtype_bytes, request.dtype_bytes).compute_key()
        rank_hardware = per_rank_hardware(request.hardware.for_workload(key), ranks)
        for m in sorted(set(request.micro_batches)):
            full = Workload(shape, size, m, request.dtype_bytes, request.dtype_bytes)
            workload = Workload(rank_shape, size, m, request.dtype_bytes, request.dtype_bytes)
            devices = {"greedysnake": greedysnake_device_bytes(full, request.hardware, request.prefetch_depth),
                       "zero_infinity": zero_infinity_device_bytes(full, request.hardware, request.zero_settings)}
            for engine in request.engines:
                if not fits(devices[engine], request.hardware):
                    refused[engine].append((size, m, f"device memory {devices[engine].total / 2**30:.1f} GiB > "
                                                     f"{request.hardware.device_memory_bytes / 2**30:.1f} GiB"))
                    continue
                point = _predict(engine, request, full, workload, rank_hardware, budget, refused[engine])
                if point is not None:
                    point.device = devices[engine]
                    found[engine].append(point)
    return {engine: Saturation(engine, found[engine], refused=refused[engine]) for engine in request.engines}


def _predict(engine: str, request: SweepRequest, full: Workload, workload: Workload, hardware: Hardware,
             budget: float, refused: list) -> Optional[SweepPoint]:
    ranks = request.ranks
    if engine == "zero_infinity":
        phases = horizontal_phases(workload, hardware, request.zero_settings)
        add_collectives(phases, request.shape, full, hardware, ranks, engine, request.zero_settings)
        prediction = evaluate("ZeRO-Infinity", phases, workload, {})
    else:
        hook = lambda phases: add_collectives(phases, request.shape, full, hardware, ranks, engine)
        splits = request.splits if request.splits is not None else sweep_splits(len(full.shape.layers), request.ideal)
        try:
            plan = best_plan_for(workload, hardware, budget, request.zero_settings, engine=not request.ideal,
                                 splits=splits, settings=request.engine_settings, phase_hook=hook)
        except BudgetTooSmall as error:
            refused.append((workload.micro_batch_size, workload.micro_batches, f"host memory: {error}"))
            return None
        prediction = plan.prediction
    return SweepPoint(engine, workload.micro_batch_size, workload.micro_batches, ranks,
                      ranks * workload.tokens_per_step / prediction.seconds, prediction.seconds, prediction.binding)


def saturated_ratio(saturations: Dict[str, Saturation]) -> float:
    """greedysnake's saturated tokens/s over ZeRO-Infinity's."""
    return saturations["greedysnake"].plateau.tokens_per_second / saturations["zero_infinity"].plateau.tokens_per_second
