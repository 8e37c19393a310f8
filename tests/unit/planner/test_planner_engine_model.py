"""The engine's model: host-resident optimizer states of the front layers, per-transfer and per-update
costs, and the training compute sharing the CPU's cores with the optimizer worker."""
import pytest

from ds_greedysnake.planner.cost_model import Rates, Workload, evaluate
from ds_greedysnake.planner.zero_model import HorizontalSettings
from ds_greedysnake.planner.engine_model import (EngineSettings, engine_phases, layers_updated_after_decision,
                                                 optimizer_host_layers, slot_bytes)
from ds_greedysnake.planner.errors import PlannerError
from ds_greedysnake.planner.hardware import Hardware, hardware_from_dict
from ds_greedysnake.planner.search import best_plan_for
from ds_greedysnake.planner.shapes import named_shape
from ds_greedysnake.settings import settings_from_ds_config

MIB = 2**20


def machine(**overrides) -> Hardware:
    values = dict(name="test", source="unit test", ssd_read_bytes_per_s=1000 * MIB, ssd_write_bytes_per_s=1000 * MIB,
                  adam_elements_per_s=2e9, device_flops_per_s=1e11)
    values.update(overrides)
    return Hardware(**values)


def ssd_bound(m: int = 1) -> Workload:
    return Workload(named_shape("ab-ssd-bound"), 1, m)  # embedding, 8 blocks, head


def state_slot(layer) -> int:
    return slot_bytes(12 * layer.params)


def test_eligible_layers_are_the_ones_updated_after_the_decision():
    assert layers_updated_after_decision(10, True, 2, False) == 2
    assert layers_updated_after_decision(10, False, 2, False) == 10
    assert layers_updated_after_decision(10, True, 2, True) == 10


def test_optimizer_host_layers_are_a_prefix_that_fits():
    workload = ssd_bound()
    layers = workload.shape.layers
    first_two = state_slot(layers[0]) + state_slot(layers[1])
    assert slot_bytes(1) == 4096 and slot_bytes(4096) == 4096
    assert optimizer_host_layers(workload, 2, 1024 * MIB) == 2           # both eligible layers fit
    assert optimizer_host_layers(workload, 2, first_two) == 2            # exactly
    assert optimizer_host_layers(workload, 2, first_two - 1) == 1        # the second does not fit: stop
    assert optimizer_host_layers(workload, 2, state_slot(layers[0]) - 1) == 0
    assert optimizer_host_layers(workload, 10, first_two + state_slot(layers[2])) == 3


def test_engine_settings_read_the_block_and_the_default_split():
    workload = ssd_bound()
    default = EngineSettings.from_settings(settings_from_ds_config({"gradient_clipping": 0.0}))
    assert default.optimizer_host_bytes == 1024 * MIB and default.deferred(workload) == 2
    assert default.optimizer_host_layers(workload) == 2
    off = EngineSettings.from_settings(settings_from_ds_config({"gradient_clipping": 0.0,
                                                                "greedysnake": {"optimizer_host_memory_mb": 0}}))
    assert off.optimizer_host_layers(workload) == 0
    # Clipping defers every layer: every layer is eligible, and the budget decides (1 GiB holds all ten).
    clipped = EngineSettings.from_settings(settings_from_ds_config({"greedysnake": {"deferred_layers": 3}}))
    assert clipped.deferred(workload) == 10 and clipped.optimizer_host_layers(workload) == 10
    three = EngineSettings.from_settings(settings_from_ds_config({"gradient_clipping": 0.0,
                                                                  "greedysnake": {"deferred_layers": 3}}))
    assert three.optimizer_host_layers(workload) == 3


def test_host_states_remove_the_state_traffic_of_the_front_update():
    """Layer 0's update, which the first forward waits for: with its states in host memory it reads and
    writes no state on SSD (still its gradient when not in host memory, and its new weights)."""
    workload, hardware = ssd_bound(), machine()
    params = workload.shape.layers[0].params
    rate = 1000 * MIB
    read = 4 * params / rate
    on_ssd, in_host = (engine_phases(workload, hardware, 2, True, host)[0].serial.value({}) for host in (0, 1))
    assert on_ssd == pytest.approx((16 * params + 16 * params) / rate + params / 2e9 + read)
    assert in_host == pytest.approx((4 * params + 4 * params) / rate + params / 2e9 + read)
    with pytest.raises(PlannerError, match="optimizer_host_layers must be between 0 and 2"):
        engine_phases(workload, hardware, 2, True, 3)
    assert len(engine_phases(workload, hardware, 2, False, 10)) == 2 * 10  # no overlap: every layer eligible


def test_transfer_and_update_costs():
    rates = Rates(machine(ssd_read_seconds_per_transfer=0.002))
    assert rates.read_seconds("param", 1000 * MIB).value({}) == pytest.approx(1.002)
    assert rates.read_seconds("param", 1000 * MIB).value({"param": 1.0}) == 0  # nothing read, no fixed cost
    workload = ssd_bound()
    params = workload.shape.layers[0].params
    read = 4 * params / (1000 * MIB)
    # From the rates: layer 0's update has one fixed cost for its reads, one for its writes; then its read.
    fixed = machine(ssd_read_seconds_per_transfer=0.002, ssd_write_seconds_per_transfer=0.001)
    plain = engine_phases(workload, machine(), 2)[0].serial.value({})
    assert engine_phases(workload, fixed, 2)[0].serial.value({}) - plain == pytest.approx(0.002 + 0.001 + 0.002)
    # Measured updates: per parameter, with states in host memory and what their SSD round trip adds.
    measured = machine(update_seconds_per_element=1e-9, update_state_io_seconds_per_element=5e-9)
    for host_layers, per_element in ((0, 6e-9), (1, 1e-9)):
        serial = engine_phases(workload, measured, 2, True, host_layers)[0].serial
        assert serial.value({"grad": 1.0}) == pytest.approx(params * per_element + read)
        assert serial.value({}) == pytest.approx(params * per_element + read + read)  # the gradient read too
        assert serial.value({"opt": 1.0, "grad": 1.0}) == pytest.approx(params * 1e-9 + read)


def test_sharing_cores_slows_both_lanes_of_a_phase():
    workload = ssd_bound(8)
    alone = {phase.name: phase for phase in engine_phases(workload, machine(), 2)}
    shared = {phase.name: phase for phase in engine_phases(workload, machine(compute_slowdown_sharing_cores=2.0), 2)}
    phase = "backward[4]"
    compute, worker = (alone[phase].lanes[name].value({}) for name in ("compute", "optimizer worker"))
    assert shared[phase].lanes["compute"].value({}) == pytest.approx(compute + 0.5 * worker)
    assert shared[phase].lanes["optimizer worker"].value({}) == pytest.approx(worker + 0.5 * compute)
    # A phase with no update running is not slowed.
    assert shared["forward[4]"].lanes["compute"].value({}) == alone["forward[4]"].lanes["compute"].value({})


def test_new_hardware_fields_are_checked():
    fields = dict(name="f", source="s", ssd_read_bytes_per_s=1, ssd_write_bytes_per_s=1, adam_elements_per_s=1,
                  device_flops_per_s=1)
    assert hardware_from_dict(dict(fields, ssd_read_seconds_per_transfer=0)).ssd_read_seconds_per_transfer == 0
    with pytest.raises(PlannerError, match="ssd_write_seconds_per_transfer must be a number >= 0"):
        hardware_from_dict(dict(fields, ssd_write_seconds_per_transfer=-1))
    with pytest.raises(PlannerError, match="compute_slowdown_sharing_cores must be a number >= 1"):
        hardware_from_dict(dict(fields, compute_slowdown_sharing_cores=0.5))


def test_plan_block_gives_the_engine_exactly_the_planned_host_states():
    """The block's optimizer_host_memory_mb makes the engine's rule pick the plan's layers, no more."""
    workload = ssd_bound(4)
    settings = EngineSettings(clipping=False)
    plan = best_plan_for(workload, machine(), 64 * 2**30, HorizontalSettings(), settings=settings)
    assert plan.optimizer_host_layers == plan.deferred_layers > 0  # all eligible: states off the boundary's path
    block = plan.greedysnake_block()
    applied = EngineSettings.from_settings(settings_from_ds_config({"gradient_clipping": 0.0, "greedysnake": block}))
    assert applied.optimizer_host_layers(workload) == plan.optimizer_host_layers
    expected = sum(state_slot(layer) for layer in workload.shape.layers[:plan.optimizer_host_layers])
    assert block["optimizer_host_memory_mb"] * MIB == expected
    assert plan.host_bytes >= expected
    # The evaluation the accuracy script makes of that block gives the plan's prediction back; without
    # the host states the same split is slower.
    def seconds(host_layers):
        phases = engine_phases(workload, machine(), plan.deferred_layers, True, host_layers)
        return evaluate("gs", phases, workload, plan.shares).seconds
    assert seconds(applied.optimizer_host_layers(workload)) == pytest.approx(plan.prediction.seconds)
    assert seconds(0) > plan.prediction.seconds


def test_the_ssd_lane_holds_the_training_process_bytes_and_the_worker_lane_its_update():
    """In a phase where the worker updates a layer while training prefetches another, the SSD lane holds the
    training process's transfers; the worker's are in its update's time (the probe times the update with its
    reads and writes in flight together), not added at R then W (docs/planner.md, issue 33)."""
    workload, hardware = ssd_bound(1), machine(ssd_read_bytes_per_s=500 * MIB, ssd_write_bytes_per_s=400 * MIB)
    phase = next(phase for phase in engine_phases(workload, hardware, 2) if phase.name == "backward[4]")
    block, param_bytes = workload.shape.layers[4].params, workload.param_bytes
    # The prefetch reads layer 3; the gradient flushed by layer 4's backward is written. Nothing in host memory.
    shares = {"grad": 0.0, "opt": 0.0, "param": 0.0, "act": 1.0}
    ssd = phase.lanes["SSD"].value(shares)
    assert ssd == pytest.approx(param_bytes * block / (500 * MIB) + 4 * block / (400 * MIB))
    # The worker updates layer 5: its states and gradient read, states and new weights written, and Adam.
    worker = phase.lanes["optimizer worker"].value(shares)
    assert worker > (12 + 4) * block / (500 * MIB) + (12 + param_bytes) * block / (400 * MIB)
    assert phase.seconds(shares)[0] >= max(worker, phase.lanes["prefetch"].value(shares), ssd)
