"""The configuration search: for each M and optimizer split, a linear programme over the placement
shares under a host-memory budget (SciPy's ``linprog``, HiGHS), then the best plan.

For fixed M and split, the step time ``sum_k repeat_k * T_k`` is minimised subject to
``T_k >= serial_k(x) + lane_kj(x)`` for every phase k and lane j, and the host bytes of the shares
x = (act, param, opt, grad) within the budget. For the engine that sum is a bound the LP can take (it ties
each update to the phase it is submitted in); the plans it gives for each split are compared by
``evaluate``, which runs the engine's step as a timeline beside the optimizer worker's queue
(``worker_queue.py``). Shares the engine cannot place in host memory
(parameters; optimizer states other than whole front layers') are bounded to 0 when the plan is to be
applied. The front layers' optimizer states (``optimizer_host_memory_mb``) are whole layers: each split
is solved with as many of them in host memory as the budget holds, and with none.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy
from scipy.optimize import linprog

from .cost_model import (GRAD_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM, SHARES, Linear, Phase, StepPrediction,
                         Workload, evaluate, ideal_vertical_phases, in_host)
from .engine_model import (EngineSettings, engine_phases, layers_updated_after_decision, optimizer_host_layers,
                           slot_bytes)
from .errors import PlannerError
from .hardware import Hardware
from .zero_model import HorizontalSettings, horizontal_phases
from ..runtime.schedule import default_deferred_layers

GIB = 2**30
MIB = 2**20
# The engine keeps parameters on SSD, and optimizer states too but for whole front layers (not a share).
ENGINE_SHARES = ("act", "grad")


class BudgetTooSmall(PlannerError):
    def __init__(self, budget_bytes: float, smallest_bytes: float, what: str):
        self.budget_bytes, self.smallest_bytes = budget_bytes, smallest_bytes
        super().__init__(f"host-memory budget {budget_bytes / GIB:.3f} GiB is below the smallest any plan needs, "
                         f"{smallest_bytes / GIB:.3f} GiB ({what}): give at least --host-memory "
                         f"{_ceil_to(smallest_bytes / GIB, 3):.3f}")


def _ceil_to(value: float, digits: int) -> float:
    scale = 10 ** digits
    return -(-value * scale // 1) / scale


def host_bytes(workload: Workload) -> Linear:
    """Host memory of a plan, linear in the shares: the engine's fixed staging buffers (two parameter
    buffers, the optimizer's state and gradient buffers in the training process and in the worker,
    for the largest layer) plus the host shares of checkpoints, parameters, optimizer states and
    gradients."""
    layers = workload.shape.layers
    largest = max(layer.params for layer in layers)
    params = sum(layer.params for layer in layers)
    fixed = largest * (2 * workload.param_bytes + 2 * (OPTIMIZER_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM) + 4)
    checkpoints = workload.micro_batches * (len(layers) - 1) * workload.checkpoint_bytes
    return (Linear(fixed) + in_host("act", checkpoints) + in_host("param", workload.param_bytes * params)
            + in_host("opt", OPTIMIZER_BYTES_PER_PARAM * params) + in_host("grad", GRAD_BYTES_PER_PARAM * params))


def solve_placement(phases: List[Phase], memory: Linear, budget_bytes: float,
                    free_shares: Sequence[str]) -> Dict[str, float]:
    """The shares minimising the step time; raises BudgetTooSmall when no share fits the budget."""
    if memory.const > budget_bytes:
        raise BudgetTooSmall(budget_bytes, memory.const, "staging buffers for the largest layer")
    count = len(SHARES) + len(phases)
    objective = numpy.zeros(count)
    rows, bounds_rhs = [], []
    for k, phase in enumerate(phases):
        column = len(SHARES) + k
        objective[column] = phase.repeat
        for lane in list(phase.lanes.values()) or [Linear()]:
            total = phase.serial + lane
            row = numpy.zeros(count)
            for i, share in enumerate(SHARES):
                row[i] = total.coefs.get(share, 0.0)
            row[column] = -1.0
            rows.append(row)
            bounds_rhs.append(-total.const)
    memory_row = numpy.zeros(count)
    for i, share in enumerate(SHARES):
        memory_row[i] = memory.coefs.get(share, 0.0)
    rows.append(memory_row)
    bounds_rhs.append(budget_bytes - memory.const)
    bounds = [(0.0, 1.0 if share in free_shares else 0.0) for share in SHARES] + [(0.0, None)] * len(phases)
    # Scale rows so that seconds and bytes are both of order one for the solver.
    matrix, rhs = numpy.array(rows), numpy.array(bounds_rhs)
    scale = numpy.maximum(numpy.abs(matrix).max(axis=1), 1e-30)
    result = linprog(objective, A_ub=matrix / scale[:, None], b_ub=rhs / scale, bounds=bounds, method="highs")
    if result.status != 0:
        raise PlannerError(f"the placement LP did not solve: {result.message}")
    return {share: float(min(1.0, max(0.0, value))) for share, value in zip(SHARES, result.x[:len(SHARES)])}


@dataclass
class Plan:
    micro_batches: int
    deferred_layers: Optional[int]      # the engine's optimizer split (layers); None for the ideal model
    alpha: Optional[float]              # the ideal model's split (share of each layer's optimizer work)
    shares: Dict[str, float]
    host_bytes: float
    prediction: StepPrediction
    zero_infinity: StepPrediction
    workload: Workload = field(repr=False)
    optimizer_host_layers: int = 0      # front layers whose optimizer states the engine keeps in host memory

    def greedysnake_block(self) -> dict:
        """The ds_config block the engine runs this plan with (checkpoint budget rounded up to a MiB)."""
        layers = self.workload.shape.layers
        checkpoints = self.micro_batches * (len(layers) - 1) * self.workload.checkpoint_bytes
        # Whole gradient slots of 4096-byte multiples, counted from the last layer as the engine assigns them.
        slots = [-(-GRAD_BYTES_PER_PARAM * layer.params // 4096) * 4096 for layer in reversed(layers)]
        wanted, gradient_bytes = self.shares["grad"] * sum(slots), 0
        for slot in slots:
            if gradient_bytes + slot > wanted * (1 + 1e-9):
                break
            gradient_bytes += slot
        # Exactly the slots of the front layers chosen (the engine stops at the first that does not fit).
        states = sum(slot_bytes(OPTIMIZER_BYTES_PER_PARAM * layer.params) for layer in layers[:self.optimizer_host_layers])
        return {"enabled": True, "deferred_layers": self.deferred_layers,
                "activation_host_memory_mb": float(-(-self.shares["act"] * checkpoints // MIB)),
                "gradient_host_memory_mb": float(-(-gradient_bytes // MIB)),
                "optimizer_host_memory_mb": states / MIB}

    def to_dict(self) -> dict:
        return {"micro_batches": self.micro_batches, "deferred_layers": self.deferred_layers, "alpha": self.alpha,
                "shares_in_host_memory": self.shares, "optimizer_host_layers": self.optimizer_host_layers,
                "host_memory_bytes": self.host_bytes,
                "greedysnake": self.prediction.to_dict(), "zero_infinity": self.zero_infinity.to_dict()}


def default_deferred_candidates(num_layers: int) -> List[int]:
    """The engine's default first, so that a tie keeps it; then every layer count (every 1/16th of them
    for deep models)."""
    step = max(1, num_layers // 16)
    default = default_deferred_layers(num_layers)
    return [default] + sorted((set(range(0, num_layers + 1, step)) | {num_layers}) - {default})


def best_plan_for(workload: Workload, hardware: Hardware, budget_bytes: float, zero_settings: HorizontalSettings,
                  engine: bool = True, modelled_shares: bool = False,
                  splits: Optional[Iterable] = None, settings: EngineSettings = EngineSettings(),
                  phase_hook: Optional[Callable[[List[Phase]], None]] = None) -> Plan:
    """The best split and placement for one M. ``engine``: the engine as it is (split in layers),
    else the paper's ideal model (split alpha). ``modelled_shares``: let parameters and optimizer
    states live in host memory too (modelled, not implemented by the engine). ``phase_hook``: called on
    greedysnake's phases before they are solved (data parallelism adds its collectives there)."""
    memory = host_bytes(workload)
    free = SHARES if modelled_shares else ENGINE_SHARES
    layers = len(workload.shape.layers)
    if engine and settings.clipping:
        candidates = [layers]  # the engine defers every update while clipping is on
    elif engine:
        candidates = list(splits) if splits is not None else default_deferred_candidates(layers)
    else:
        candidates = list(splits) if splits is not None else [i / 8 for i in range(9)]
    best = None
    for split in candidates:
        for host_layers in (_host_state_candidates(workload, split, settings, budget_bytes - memory.const)
                            if engine else [0]):
            phases = (engine_phases(workload, hardware, split, settings.overlap, host_layers) if engine
                      else ideal_vertical_phases(workload, hardware, split))
            if phase_hook is not None:
                phase_hook(phases)
            states = Linear(sum(slot_bytes(OPTIMIZER_BYTES_PER_PARAM * layer.params)
                                for layer in workload.shape.layers[:host_layers]))
            shares = solve_placement(phases, memory + states, budget_bytes, free)
            shares = _fill_host(shares, memory + states, budget_bytes, free)
            prediction = evaluate("greedysnake" if engine else "greedysnake (ideal)", phases, workload, shares)
            if best is None or prediction.seconds < best[0].seconds - 1e-12:
                best = (prediction, split, shares, host_layers, states.const)
    prediction, split, shares, host_layers, states_bytes = best
    zero = evaluate("ZeRO-Infinity", horizontal_phases(workload, hardware, zero_settings), workload, {})
    return Plan(workload.micro_batches, split if engine else None, None if engine else split, shares,
                memory.value(shares) + states_bytes, prediction, zero, workload, host_layers)


def _host_state_candidates(workload: Workload, split: int, settings: EngineSettings, left_bytes: float) -> List[int]:
    """Front layers with optimizer states in host memory: as many as the budget left holds (after the
    staging buffers), and none (when checkpoints or gradients would gain more from that memory)."""
    eligible = layers_updated_after_decision(len(workload.shape.layers), settings.overlap, split, settings.clipping)
    most = optimizer_host_layers(workload, eligible, max(0.0, left_bytes))
    return sorted({most, 0}, reverse=True)


def _fill_host(shares: Dict[str, float], memory: Linear, budget_bytes: float, free: Sequence[str]) -> Dict[str, float]:
    """Keep in host memory whatever the budget still holds, in the order that saves the most SSD traffic
    per byte (checkpoints, then optimizer states, then parameters): never slower, often equal."""
    shares = dict(shares)
    for share in ("act", "grad", "opt", "param"):
        if share not in free:
            continue
        left = budget_bytes - memory.value(shares)
        coef = memory.coefs.get(share, 0.0)
        if coef > 0 and left > 0:
            shares[share] = min(1.0, shares[share] + left / coef)
    return shares


def search(workload: Workload, hardware: Hardware, budget_bytes: float, zero_settings: HorizontalSettings,
           micro_batch_candidates: Sequence[int], engine: bool = True, modelled_shares: bool = False,
           knee: float = 0.95, settings: EngineSettings = EngineSettings()) -> List[Plan]:
    """A plan per M; the recommended one (first in the list) is the smallest M within ``knee`` of the
    best tokens/s: more micro-batches only add memory and latency past the saturation knee."""
    plans = []
    for m in sorted(set(micro_batch_candidates)):
        sized = Workload(workload.shape, workload.micro_batch_size, m, workload.param_bytes, workload.activation_bytes)
        plans.append(best_plan_for(sized, hardware, budget_bytes, zero_settings, engine, modelled_shares,
                                   settings=settings))
    best_rate = max(plan.prediction.tokens_per_second for plan in plans)
    chosen = next(plan for plan in plans if plan.prediction.tokens_per_second >= knee * best_rate)
    return [chosen] + [plan for plan in plans if plan is not chosen]
