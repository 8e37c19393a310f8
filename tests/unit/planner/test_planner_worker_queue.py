"""The engine's step as a timeline beside the optimizer worker's queue (``planner/worker_queue.py``): the
queue's order, the waits it causes, and how ``engine_phases`` links its phases to it."""
import pytest

from ds_greedysnake.planner.cost_model import Linear, Phase, Workload, evaluate
from ds_greedysnake.planner.engine_model import engine_phases
from ds_greedysnake.planner.hardware import Hardware
from ds_greedysnake.planner.shapes import named_shape
from ds_greedysnake.planner.worker_queue import WORKER_LANE, WORKER_WAIT, QueueLink, _Worker, timeline_seconds

MIB = 2**20


def test_the_worker_runs_the_lowest_layer_queued_when_it_is_free_each_to_its_end():
    worker = _Worker()
    worker.queue(0.0, 0, 5, 1.0)
    worker.queue(0.5, 0, 3, 1.0)
    worker.queue(0.5, 0, 1, 1.0)
    assert worker.finished(0, 3) == 3.0  # layer 5 started at 0 and is not preempted; then 1, then 3
    assert worker.done[(0, 5)] == 1.0 and worker.done[(0, 1)] == 2.0
    worker.queue(10.0, 1, 0, 0.5)  # queued after the worker went idle: it starts when queued
    assert worker.finished(1, 0) == 10.5
    assert worker.finished(-1, 7) == 0.0  # before the first step nothing is pending
    with pytest.raises(AssertionError, match="never queued"):
        worker.finished(1, 4)


def test_a_fetch_waits_for_its_layers_update_and_the_wait_is_named():
    """Layer 0's update (2 s, queued at the decision) runs into the next step: its forward waits for it.
    The phases alone put the update beside the backward (2.3 s a step); the timeline has the step take
    the update and every phase after one another (2.6 s)."""
    phases = [Phase("forward[0]", Linear(0.1), {"compute": Linear(0.2)}, queue=QueueLink(fetch_waits_for=0)),
              Phase("backward[0]", Linear(), {"compute": Linear(0.3), WORKER_LANE: Linear(2.0)},
                    queue=QueueLink(lane_update=0, queued_at_decision=True))]
    workload = Workload(named_shape("ab-ssd-bound"), 1, 1)
    seconds, rows = timeline_seconds(phases, {})
    assert seconds == pytest.approx(2.6)
    assert rows[0] == ("forward[0]", pytest.approx(2.3), WORKER_WAIT)
    assert rows[1] == ("backward[0]", pytest.approx(0.3), "compute")
    assert evaluate("gs", phases, workload, {}).seconds == pytest.approx(2.6)
    unlinked = [Phase(phase.name, phase.serial, phase.lanes) for phase in phases]
    assert evaluate("gs", unlinked, workload, {}).seconds == pytest.approx(2.3)  # the sum of the phases


def test_a_prefetch_waits_for_its_layers_update_and_the_longest_update_is_capped():
    phases = [Phase("forward[0]", Linear(), {"compute": Linear(0.2), "prefetch": Linear(0.1)},
                    queue=QueueLink(prefetch_waits_for=1)),
              Phase("backward[1]", Linear(), {"compute": Linear(0.4), WORKER_LANE: Linear(5.0)},
                    queue=QueueLink(lane_update=1, update_longest=Linear(1.0)))]
    seconds, rows = timeline_seconds(phases, {})
    # Layer 1's update (capped at 1 s) starts with backward[1] and ends 0.6 s after it; the prefetch then reads.
    assert seconds == pytest.approx(0.6 + 0.1 + 0.4)
    assert rows[0][2] == WORKER_WAIT


def machine(**overrides) -> Hardware:
    values = dict(name="test", source="unit test", ssd_read_bytes_per_s=1000 * MIB, ssd_write_bytes_per_s=1000 * MIB,
                  adam_elements_per_s=2e9, device_flops_per_s=1e11)
    values.update(overrides)
    return Hardware(**values)


def test_engine_phases_link_every_phase_to_the_queue_with_the_overlap_only():
    workload = Workload(named_shape("ab-ssd-bound"), 1, 1)  # embedding, 8 blocks, head: 10 layers
    phases = {phase.name: phase for phase in engine_phases(workload, machine(), 2)}
    assert all(phase.queue is not None for phase in phases.values())
    first = phases["forward[0]"].queue
    assert first.serial_update[0] == 0 and first.fetch_waits_for == 0
    assert first.lane_update == 1 and first.queued_at_decision  # deferred: queued at the decision
    assert phases["forward[1]"].queue.fetch_waits_for == 1  # its prefetch was skipped while its update ran
    assert phases["forward[1]"].queue.prefetch_waits_for == 2
    assert phases["backward[4]"].queue.lane_update == 5 and not phases["backward[4]"].queue.queued_at_decision
    assert all(phase.queue is None for phase in engine_phases(workload, machine(), 2, overlap=False))


def test_the_timeline_is_the_phases_sum_where_the_worker_never_binds_and_less_where_it_does():
    workload = Workload(named_shape("ab-ssd-bound"), 1, 8)
    # A cheap update: Adam nearly free and its gradient kept in host memory (no SSD read in the update).
    cheap = machine(update_seconds_per_element=1e-12, update_state_io_seconds_per_element=1e-12)
    in_host = {"grad": 1.0}
    phases = engine_phases(workload, cheap, 2)
    assert max(phase.lanes["optimizer worker"].value(in_host) for phase in phases
               if "optimizer worker" in phase.lanes) < 1e-3
    summed = sum(phase.seconds(in_host)[0] for phase in phases)
    assert evaluate("gs", phases, workload, in_host).seconds == pytest.approx(summed)
    # Updates far longer than the compute: the step is the worker's, at least every update one after another,
    # and less than the phases' sum, which adds the forward's reads after each phase's update.
    slow = machine(update_seconds_per_element=1e-7, update_state_io_seconds_per_element=1e-7)
    one = Workload(named_shape("ab-ssd-bound"), 1, 1)
    phases = engine_phases(one, slow, 2)
    updates = sum(layer.params for layer in one.shape.layers) * 2e-7
    step = evaluate("gs", phases, one, {}).seconds
    assert updates <= step < sum(phase.seconds({})[0] for phase in phases)
