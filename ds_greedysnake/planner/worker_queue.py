"""A step of ds_greedysnake's engine as a timeline: the training process runs its phases one after another
while the optimizer worker runs the queued layer updates, each as soon as it is queued and the worker is
free, lowest layer first; a phase that reads a layer's parameters waits for that layer's update.

The phases alone (``cost_model.evaluate`` summing ``serial + max(lanes)``) tie each update to the phase it
is submitted in: there it adds to the phase's time when it is the slowest lane. The worker is a queue, not
a lane: an update that outlasts its phase runs on into the next ones and only delays the training where
a fetch needs its layer. Measured on four unseen shapes (issue 33, docs/planner.md) the phases put
greedysnake's M=1 step 1.08-1.36x above the measured one: there the worker is busy for most of the step
(0.92-1.16 s of 1.05-1.11 s at hidden 880), and the next forward's parameter reads ran behind its tail,
where the phases had added both.

Each phase says how it meets the queue (``QueueLink``): the update its "optimizer worker" lane (or, for
forward[0], its serial part) holds, when that update is queued (as its phase starts: its gradient was just
handed over; or at the step's decision, for the deferred front layers), and which update its fetch (the
serial part) or its prefetch (the "prefetch" lane) waits for. Everything else of a phase is as the phases
model it, including the shared cores' surcharge on its compute and on the update; the update's time is
capped at the slow-down times its time alone (``QueueLink.update_longest``): the lane's surcharge grows with
the phase's compute, but the worker is slowed only while both run (measured at hidden 784, micro-batch 4,
M=8: 0.41 s of updates a step, where the lanes summed to 2.02 s).

The steady state: the timeline runs ``STEPS`` steps from an idle worker and returns the last one's time
(the updates one step queues are read by the next one's forward).
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # cost_model.evaluate runs this module's timeline: no import back at run time
    from .cost_model import Linear

WORKER_LANE = "optimizer worker"
PREFETCH_LANE = "prefetch"
WORKER_WAIT = "fetch wait (optimizer worker)"
STEPS = 4


@dataclass(frozen=True)
class QueueLink:
    """How one phase meets the optimizer worker's queue. Updates queued at the decision are queued in the
    order of the phases that hold them."""
    lane_update: Optional[int] = None         # the layer whose update the "optimizer worker" lane holds
    update_longest: Optional["Linear"] = None # the most that update takes beside training (slow-down x alone):
                                              # the lane's share of the phase's compute stops at the update's end
    queued_at_decision: bool = False          # that update is queued at the step's decision, not as the phase starts
    serial_update: Optional[Tuple[int, "Linear"]] = None  # (layer, seconds) of an update the serial part holds,
                                              # queued at the decision (forward[0]: layer 0's)
    fetch_waits_for: Optional[int] = None     # the layer whose update the serial fetch waits for
    prefetch_waits_for: Optional[int] = None  # the layer whose update the prefetch waits for


class _Worker:
    """The worker's queue over several steps: updates as (step, layer), run lowest (step, layer) first among
    those queued when the worker is free; one at a time, each to its end."""

    def __init__(self):
        self.free_at = 0.0
        self.queued: List[Tuple[float, int, int, float]] = []   # (queued at, step, layer, seconds)
        self.done: Dict[Tuple[int, int], float] = {}

    def queue(self, at: float, step: int, layer: int, seconds: float) -> None:
        self.queued.append((at, step, layer, seconds))

    def finished(self, step: int, layer: int) -> float:
        """When update (step, layer) ends, running what is queued until it has; before the first step, 0."""
        if step < 0:
            return 0.0
        while (step, layer) not in self.done:
            if not self.queued:
                raise AssertionError(f"layer {layer}'s update of step {step} is waited for but was never queued")
            start = max(self.free_at, min(entry[0] for entry in self.queued))
            entry = min((entry for entry in self.queued if entry[0] <= start), key=lambda item: (item[1], item[2]))
            self.queued.remove(entry)
            self.free_at = start + entry[3]
            self.done[(entry[1], entry[2])] = self.free_at
        return self.done[(step, layer)]


def _run_phase(phase, shares: Dict[str, float], started: float, worker: _Worker, step: int) -> Tuple[float, str]:
    """When the phase ends and what bound it; its update runs in the worker, not here."""
    link = phase.queue
    values = {name: lane.value(shares) for name, lane in phase.lanes.items() if name != WORKER_LANE}
    serial = phase.serial.value(shares)
    if link.serial_update is not None:
        serial -= link.serial_update[1].value(shares)
    fetched = started + serial
    ends = {name: fetched + value for name, value in values.items()}
    if PREFETCH_LANE in values and link.prefetch_waits_for is not None:
        ready = worker.finished(step - 1, link.prefetch_waits_for)
        if ready > fetched:
            del ends[PREFETCH_LANE]
            ends[WORKER_WAIT] = ready + values[PREFETCH_LANE]
    end, binding = fetched, phase.serial_name
    if ends:
        binding = max(ends, key=ends.get)
        end = max(end, ends[binding])
    return end, binding


def timeline_seconds(phases, shares: Dict[str, float]) -> Tuple[float, List[Tuple[str, float, str]]]:
    """The steady-state step: (seconds, per phase (name, seconds, binding)); a phase's wait for the worker
    counts in that phase, named ``WORKER_WAIT`` where it is most of the phase."""
    worker, now, rows, step_seconds = _Worker(), 0.0, [], 0.0
    for step in range(STEPS):
        step_start, rows, at_decision = now, [], []
        for phase in phases:
            link = phase.queue
            if link.serial_update is not None:
                at_decision.append((link.serial_update[0], link.serial_update[1].value(shares)))
            if link.lane_update is not None:
                seconds = phase.lanes[WORKER_LANE].value(shares)
                if link.update_longest is not None:
                    seconds = min(seconds, link.update_longest.value(shares))
                if link.queued_at_decision:
                    at_decision.append((link.lane_update, seconds))
                else:  # its gradient was handed over as the phase started
                    worker.queue(now, step, link.lane_update, seconds)
            started = now
            if link.fetch_waits_for is not None:
                started = max(now, worker.finished(step - 1, link.fetch_waits_for))
            end, binding = _run_phase(phase, shares, started, worker, step)
            if started - now > end - started:
                binding = WORKER_WAIT
            rows.append((phase.name, end - now, binding))
            now = end
        for layer, seconds in at_decision:
            worker.queue(now, step, layer, seconds)
        step_seconds = now - step_start
    return step_seconds, rows
