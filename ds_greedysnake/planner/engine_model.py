"""ds_greedysnake's engine as it runs, as phases of the cost model (docs/planner.md, "The engine, as
modelled").

The optimizer worker reads, steps and writes one layer at a time, in order; a gradient not kept in
host memory is written synchronously; the front ``deferred_layers`` updates run after the step's
decision and the next forward waits for each before reading that layer. Front layers updated only
after the decision may keep their optimizer states in host memory (``optimizer_host_memory_mb``):
their update moves no state through SSD.

Three things the rates alone do not say, measured by the probe (``hardware.py``):
* every SsdStore transfer has a fixed cost on top of its bytes (``ssd_*_seconds_per_transfer``);
* a layer update, timed as the worker runs it (``update_seconds_per_element`` with its states in host
  memory, ``update_state_io_seconds_per_element`` for their SSD round trip);
* on the CPU accelerator the worker shares the cores with training: while it runs, the training
  compute slows (``compute_slowdown_sharing_cores``).
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional

from .cost_model import (GRAD_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM, Linear, Phase, Rates, Workload, layer_times,
                         on_ssd)
from ..runtime.schedule import default_deferred_layers, layers_updated_after_decision
from .errors import PlannerError
from .hardware import Hardware, LayerTimes
from .worker_queue import QueueLink

if TYPE_CHECKING:  # the model stays free of torch and DeepSpeed, which settings.py imports
    from ..settings import Settings

SLOT_ALIGNMENT = 4096  # the engine's host-memory slots are whole 4096-byte multiples


def slot_bytes(num_bytes: int) -> int:
    return -(-num_bytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT




def optimizer_host_layers(workload: Workload, eligible: int, budget_bytes: float) -> int:
    """How many front layers get their optimizer states in host memory, as the engine assigns them: from
    layer 0 up, among the eligible ones, while the running total of slots fits the budget."""
    held = 0.0
    for count, layer in enumerate(workload.shape.layers[:eligible]):
        held += slot_bytes(OPTIMIZER_BYTES_PER_PARAM * layer.params)
        if held > budget_bytes:
            return count
    return eligible


@dataclass
class EngineSettings:
    """What of the settings changes the engine's schedule and placement."""
    overlap: bool = True     # greedysnake.optimizer_overlap
    clipping: bool = False   # gradient_clipping > 0: every update waits for the global norm (deferred)
    gradient_host_bytes: float = 1024 * 2**20   # greedysnake.gradient_host_memory_mb (the engine's default)
    optimizer_host_bytes: float = 1024 * 2**20  # greedysnake.optimizer_host_memory_mb (the engine's default)
    deferred_layers: Optional[int] = None       # greedysnake.deferred_layers; None: the engine's default

    @classmethod
    def from_settings(cls, settings: "Settings") -> "EngineSettings":
        block = settings.greedysnake
        # DeepSpeed 0.19.8 clips at 1.0 when gradient_clipping is absent (design doc, section 7).
        return cls(overlap=block.optimizer_overlap, clipping=settings.gradient_clipping > 0,
                   gradient_host_bytes=float(block.gradient_host_memory_mb) * 2**20,
                   optimizer_host_bytes=float(block.optimizer_host_memory_mb) * 2**20,
                   deferred_layers=block.deferred_layers)

    def deferred(self, workload: Workload) -> int:
        """The split the engine runs: every layer while clipping is on, else the block's or the default."""
        count = len(workload.shape.layers)
        if self.clipping:
            return count
        return default_deferred_layers(count) if self.deferred_layers is None else self.deferred_layers

    def optimizer_host_layers(self, workload: Workload, deferred: Optional[int] = None) -> int:
        count = len(workload.shape.layers)
        eligible = layers_updated_after_decision(count, self.overlap,
                                                 self.deferred(workload) if deferred is None else deferred,
                                                 self.clipping)
        return optimizer_host_layers(workload, eligible, self.optimizer_host_bytes)

    def shares(self, workload: Workload, checkpoint_host_bytes: float) -> Dict[str, float]:
        """The host shares this configuration gives: gradient slots from the last layer down while they
        fit (as the engine's arena assigns them), checkpoints up to their budget. Optimizer states in host
        memory are whole front layers (``optimizer_host_layers``), not a share."""
        held, total = 0.0, 0.0
        for layer in reversed(workload.shape.layers):
            slot = slot_bytes(GRAD_BYTES_PER_PARAM * layer.params)
            if held + slot <= self.gradient_host_bytes and held == total:
                held += slot
            total += slot
        checkpoints = workload.micro_batches * (len(workload.shape.layers) - 1) * workload.checkpoint_bytes
        return {"grad": held / total, "act": min(1.0, checkpoint_host_bytes / checkpoints), "param": 0.0, "opt": 0.0}


def _update(params: int, workload: Workload, rates: Rates, states_in_host: bool) -> Linear:
    """The worker's seconds for one layer's update: read the states and, unless in host memory, the
    gradient (in flight together); Adam; write the states and the new weights (together). States kept
    in host memory are updated in place: no state transfer. Its SSD transfers are in these seconds (the
    probe times the update on the engine's pipeline, its reads and writes meeting on the SSD), not in a
    phase's "SSD" lane (see ``_EngineTerms.sharing_cores``).

    With the probe's measurements (``update_seconds_per_element`` with states in host memory,
    ``update_state_io_seconds_per_element`` for what their SSD round trip adds) the update is those,
    per parameter; else it is built from the rates, one fixed cost per group of transfers."""
    state_bytes = 0 if states_in_host else OPTIMIZER_BYTES_PER_PARAM * params
    grad_bytes, weight_bytes = GRAD_BYTES_PER_PARAM * params, workload.param_bytes * params
    writes = on_ssd("opt", state_bytes) + on_ssd("param", weight_bytes)
    if rates.update_host is not None and rates.update_state_io is not None:
        # Measured with the gradient in host memory and the new weights written: a gradient through SSD
        # adds its read; weights kept in host memory (modelled) save their write.
        seconds = (Linear(params * rates.update_host, {"param": -weight_bytes * rates.write})
                   + on_ssd("grad", grad_bytes) * rates.read)
        if state_bytes:
            seconds += on_ssd("opt", params * rates.update_state_io)
        return seconds
    seconds = Linear(params * rates.adam + rates.write_latency) + writes * rates.write
    if state_bytes:
        seconds += rates.read_seconds("opt", state_bytes) + on_ssd("grad", grad_bytes) * rates.read
    else:
        seconds += rates.read_seconds("grad", grad_bytes)
    return seconds


class _EngineTerms:
    """Per-layer quantities of one workload on one machine, shared by the engine's phases."""

    def __init__(self, workload: Workload, hardware: Hardware, deferred: int, overlap: bool, host_states: int):
        self.workload, self.layers = workload, workload.shape.layers
        # The layer times are taken at torch's threads; the engine trains on its training_threads.
        slower = hardware.engine_threads_slowdown or 1.0
        self.times = [LayerTimes(t.forward_s * slower, t.forward_backward_s * slower)
                      for t in layer_times(workload, hardware)]
        self.rates = Rates(hardware)
        self.count, self.m = len(self.layers), workload.micro_batches
        self.deferred, self.overlap = deferred, overlap
        self.updates = [_update(layer.params, workload, self.rates, index < host_states)
                        for index, layer in enumerate(self.layers)]
        self.param_bytes = [workload.param_bytes * layer.params for layer in self.layers]
        self.checkpoints = self.m * workload.checkpoint_bytes   # one layer's inputs, all micro-batches

    def param_read(self, index: int) -> Linear:
        return self.rates.read_seconds("param", self.param_bytes[index])

    def update_in_forward(self, index: int) -> bool:
        """Layer ``index`` is updated after the step's decision, into the next forward."""
        return self.overlap and index < self.deferred

    def sharing_cores(self, lanes: Dict[str, Linear]) -> None:
        """The worker and the training compute share the CPU's cores: while both run, each goes
        ``slowdown`` times slower than alone. With c and u their times alone, the one that finishes last
        takes c + (1 - 1/slowdown) u (compute) or u + (1 - 1/slowdown) c (the worker): each lane carries
        the other's share. Measured here at M=8 of ab_bench's ssd_bound: backward 0.30 s without the
        worker, 0.39-0.44 s with it; the worker's ten updates 0.34 s alone, 0.49-0.51 s beside training."""
        # The worker and the prefetch share one SSD. The worker's transfers are in its update's seconds (the
        # probe times the update with its reads and writes in flight together), and a phase's "SSD" lane holds
        # the training process's own (prefetch, checkpoints, gradients). Until 2026-12-05 that lane also held
        # the worker's bytes, reads at R then writes at W: at hidden 880, M=1, a step's 1.18 GB read and
        # 0.95 GB written come to 1.34 s that way where the whole step took 1.10 s (this disk serves reads
        # and writes together), and the lane bound greedysnake's M=1 steps at 1.13-1.36x the measured ones
        # (docs/planner.md, issue 33). An earlier lane added the worker's whole time to the prefetch's
        # (measured then: the worker's ten updates took 0.38-0.42 s at M=1 beside the prefetches, 0.35 s
        # inline). Since the worker reads and writes on two aio handles, its busy time per step beside the
        # prefetches (0.32-0.46 s in eight runs) is what the probe gives it alone (0.32-0.41 s), and the sum
        # put the step 1.07-1.95x above the measured one (docs/planner.md, 2026-12-01).
        if "optimizer worker" in lanes and self.rates.sharing > 0:
            compute, worker = lanes["compute"], lanes["optimizer worker"]
            lanes["compute"] = compute + worker * self.rates.sharing
            lanes["optimizer worker"] = worker + compute * self.rates.sharing


def engine_phases(workload: Workload, hardware: Hardware, deferred_layers: int, overlap: bool = True,
                  optimizer_host_layers: int = 0) -> List[Phase]:
    """``optimizer_host_layers``: front layers whose states the engine keeps in host memory; they must
    be updated only after the decision (``layers_updated_after_decision``)."""
    count = len(workload.shape.layers)
    if not 0 <= deferred_layers <= count:
        raise PlannerError(f"deferred_layers must be between 0 and {count} (the layers), got {deferred_layers}")
    eligible = deferred_layers if overlap else count
    if not 0 <= optimizer_host_layers <= eligible:
        raise PlannerError(f"optimizer_host_layers must be between 0 and {eligible} (the layers updated after the "
                           f"step's decision), got {optimizer_host_layers}")
    terms = _EngineTerms(workload, hardware, eligible, overlap, optimizer_host_layers)
    phases = [_engine_forward(terms, index) for index in range(count - 1)]
    phases += [_engine_backward(terms, index) for index in range(count - 1, -1, -1)]
    if not overlap:
        serial = Linear()
        for seconds in terms.updates:
            serial += seconds
        phases.append(Phase("optimizer", serial, {}, serial_name="optimizer step (not overlapped)"))
    return phases


def _engine_forward(terms: _EngineTerms, index: int) -> Phase:
    rates, following = terms.rates, index + 1
    # Its prefetch had nothing to overlap (layer 0) or was skipped while its update ran: read now, serially.
    reads_late = index == 0 or terms.update_in_forward(index)
    updates_following = terms.update_in_forward(following)  # the next layer's update runs now
    serial = Linear()
    if index == 0 and terms.overlap:
        serial += terms.updates[0]  # the first forward waits for layer 0's update, submitted last
    if reads_late:
        serial += terms.param_read(index)
    spill = on_ssd("act", terms.checkpoints)
    lanes = {"compute": Linear(terms.m * terms.times[index].forward_s) + spill * rates.write}
    reads, writes = Linear(), spill
    if updates_following:  # its read waits for the update
        lanes["optimizer worker"] = terms.updates[following]
    else:
        lanes["prefetch"] = terms.param_read(following)
        reads += on_ssd("param", terms.param_bytes[following])
    lanes["SSD"] = rates.ssd(reads, writes)
    terms.sharing_cores(lanes)
    rates.add_link(lanes, 2 * terms.checkpoints + terms.param_bytes[index])
    queue = None
    if terms.overlap:  # each read waits for its layer's update (queued in the step before)
        queue = QueueLink(lane_update=following if updates_following else None, queued_at_decision=updates_following,
                          update_longest=terms.updates[following] * rates.slowdown if updates_following else None,
                          serial_update=(0, terms.updates[0]) if index == 0 else None,
                          fetch_waits_for=index if reads_late else None,
                          prefetch_waits_for=None if updates_following else following)
    return Phase(f"forward[{index}]", serial, lanes, serial_name="fetch wait (update, read)", queue=queue)


def _engine_backward(terms: _EngineTerms, index: int) -> Phase:
    rates, params = terms.rates, terms.layers[index].params
    flush = on_ssd("grad", GRAD_BYTES_PER_PARAM * params)  # the gradient not kept in host memory: a synchronous write
    spilled = on_ssd("act", terms.checkpoints) if index > 0 else Linear()
    # The training thread also hands the gradient over: a copy to host memory and its squared norm.
    lanes = {"compute": Linear(terms.m * terms.times[index].forward_backward_s + params * rates.handoff)
             + rates.write_seconds("grad", GRAD_BYTES_PER_PARAM * params) + spilled * rates.read}
    reads, writes = spilled, flush
    # Layer L-2 (below the last layer) is still resident from forward: no read, no upload.
    kept_from_forward = index == terms.count - 2
    if 0 < index < terms.count - 1:
        lanes["prefetch"] = terms.param_read(index - 1)
        reads += on_ssd("param", terms.param_bytes[index - 1])
    previous = index + 1  # updated during this layer's backward, after its own flush
    if terms.overlap and previous < terms.count and not terms.update_in_forward(previous):
        lanes["optimizer worker"] = terms.updates[previous]
    lanes["SSD"] = rates.ssd(reads, writes)
    terms.sharing_cores(lanes)
    uploaded = 0 if kept_from_forward else terms.workload.param_bytes
    rates.add_link(lanes, 2 * terms.checkpoints + (uploaded + GRAD_BYTES_PER_PARAM) * params)
    # The last layer's prefetch was skipped if its update was deferred: it is read now, serially.
    waits = Linear()
    reads_late = index == terms.count - 1 and terms.update_in_forward(index)
    if reads_late:
        waits = terms.param_read(index)
    queue = None
    if terms.overlap:
        held = "optimizer worker" in lanes
        queue = QueueLink(lane_update=previous if held else None,
                          update_longest=terms.updates[previous] * rates.slowdown if held else None,
                          fetch_waits_for=index if reads_late else None)
    return Phase(f"backward[{index}]", waits, lanes, serial_name="fetch wait (update, read)", queue=queue)
