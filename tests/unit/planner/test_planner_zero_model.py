"""The planner's ZeRO-Infinity terms (issue 33): what ZeRO-3 swaps under its 1 MiB rule, its optimizer's
sub-groups, the serial optimizer step, the boundary's gradient write, ops timed by size, ZeRO-3's own costs."""
import json

import pytest

from ds_greedysnake.planner.cost_model import Rates, Workload, evaluate, op_seconds
from ds_greedysnake.planner.zero_model import (HorizontalSettings, horizontal_phases, zero_boundary_gradient_write,
                                               zero_optimizer_seconds, zero_sub_groups, zero_swapped_tensors,
                                               zero_terms)
from ds_greedysnake.planner.data_parallel import sharded_shape
from ds_greedysnake.planner.errors import PlannerError
from ds_greedysnake.planner.hardware import Hardware, hardware_from_dict
from ds_greedysnake.planner.shapes import GPTShape
from ds_greedysnake.settings import settings_from_ds_config

MIB = 2**20


def machine(**overrides) -> Hardware:
    values = dict(name="test", source="unit test", ssd_read_bytes_per_s=1000 * MIB, ssd_write_bytes_per_s=1000 * MIB,
                  ssd_read_bytes_per_s_single=500 * MIB, ssd_write_bytes_per_s_single=400 * MIB,
                  adam_elements_per_s=2e9, device_flops_per_s=1e11)
    values.update(overrides)
    return Hardware(**values)


def block_of(hidden: int):
    return GPTShape("t", 2, hidden, 4, 1024, 16).layers[1]


@pytest.mark.parametrize("hidden,element_bytes,expected", [
    # fp32: 1 MiB is 262144 elements; h*h (the attention projection) is under it at 384, not at 512
    (384, 4, [3 * 384 * 384, 4 * 384 * 384, 4 * 384 * 384]),
    (512, 4, [3 * 512 * 512, 512 * 512, 4 * 512 * 512, 4 * 512 * 512]),
    # bf16: 524288 elements; at 384 only the MLP's matrices
    (384, 2, [4 * 384 * 384, 4 * 384 * 384]),
])
def test_zero_swaps_only_tensors_of_at_least_a_mebibyte(hidden, element_bytes, expected):
    assert zero_swapped_tensors(block_of(hidden), element_bytes, HorizontalSettings()) == expected


def test_a_larger_aio_block_or_persistence_threshold_keeps_more_in_host_memory():
    block = block_of(512)
    assert zero_swapped_tensors(block, 4, HorizontalSettings(min_swap_bytes=4 * MIB)) == [4 * 512 * 512] * 2
    assert zero_swapped_tensors(block, 4, HorizontalSettings(persistence_threshold=3 * 512 * 512)) == [4 * 512 * 512] * 2


def test_each_rank_swaps_its_partition_judged_by_the_rule():
    shape = GPTShape("t", 2, 512, 4, 1024, 16)
    two = sharded_shape(shape, 2).layers[1]
    # 786432 / 2 = 393216 elements: still over 1 MiB; 262144 / 2 is not
    assert zero_swapped_tensors(two, 4, HorizontalSettings()) == [3 * 512 * 512 // 2, 2 * 512 * 512, 2 * 512 * 512]


def test_sub_groups_follow_deepspeeds_rule():
    shape = GPTShape("t", 2, 256, 4, 1024, 16)
    tensors = [n for layer in shape.layers for n in layer.tensor_numels]
    singles = zero_sub_groups(shape.layers, HorizontalSettings(sub_group_size=1))
    assert singles == [[n] for n in tensors]
    assert zero_sub_groups(shape.layers, HorizontalSettings()) == [tensors]  # 1e9: the whole model, one group
    # A group closes once it holds sub_group_size elements; the remainder is the last group.
    groups = zero_sub_groups(shape.layers, HorizontalSettings(sub_group_size=300_000))
    assert [n for group in groups for n in group] == tensors
    assert all(sum(group) >= 300_000 for group in groups[:-1])
    assert all(sum(group[:-1]) < 300_000 for group in groups)


def test_optimizer_step_is_serial_and_small_groups_stay_in_host_memory():
    shape = GPTShape("t", 2, 384, 4, 1024, 16)
    workload = Workload(shape, 1, 4)
    hardware = machine()
    rates = Rates(hardware)
    settings = HorizontalSettings(sub_group_size=1)
    parts = {name: part.value({}) for name, part in zero_optimizer_seconds(workload, rates, settings).items()}
    swapped = [n for layer in shape.layers for n in layer.tensor_numels if 4 * n >= MIB]
    assert parts["Adam"] == pytest.approx(shape.params / 2e9)  # every parameter, swapped or not
    states = sum(3 * 4 * n + 4 * n for n in swapped)           # three fp32 states and the gradient
    assert parts["optimizer state read"] == pytest.approx(states / (500 * MIB))
    assert parts["optimizer state write"] == pytest.approx(sum(12 * n for n in swapped) / (400 * MIB))
    assert parts["parameter write"] == pytest.approx(sum(4 * n for n in swapped) / (400 * MIB))
    step = next(phase for phase in horizontal_phases(workload, hardware, settings) if phase.name == "optimizer step")
    assert step.seconds({})[0] == pytest.approx(sum(parts.values()))  # one after the other, not their max
    boundary = zero_boundary_gradient_write(workload, rates, settings).value({})
    assert boundary == pytest.approx(sum(4 * n for n in swapped) / (400 * MIB))


def test_ops_timed_by_size_are_interpolated():
    seconds = op_seconds({MIB: 0.001, 4 * MIB: 0.002}, bytes_per_s=1.0)
    assert seconds(MIB) == pytest.approx(0.001) and seconds(4 * MIB) == pytest.approx(0.002)
    assert seconds(2.5 * MIB) == pytest.approx(0.0015)
    assert seconds(8 * MIB) == pytest.approx(0.004)        # above: the largest size's rate
    assert seconds(MIB / 2) == pytest.approx(0.0005)       # below: the smallest's, by size
    assert op_seconds({}, bytes_per_s=1000.0)(500) == pytest.approx(0.5)


def test_zero_terms_add_up_to_the_step_and_use_zero_3s_own_costs():
    shape = GPTShape("t", 3, 512, 4, 1024, 16)
    workload = Workload(shape, 1, 4)
    settings = HorizontalSettings(sub_group_size=1)
    plain = machine()
    own = machine(zero_seconds_per_fetch=0.01, zero_grad_reduce_elements_per_s=1e9,
                  zero_optimizer_seconds_per_element={"Adam": 1e-9, "gradient write (boundary)": 2e-9,
                                                      "optimizer step, beyond its parts": 3e-10},
                  zero_read_seconds_by_size={4 * 512 * 512 * 4: 0.02, 1024 * 512 * 4: 0.01})
    for hardware in (plain, own):
        terms = zero_terms(workload, hardware, settings)
        step = evaluate("zi", horizontal_phases(workload, hardware, settings), workload, {}).seconds
        assert step == pytest.approx(sum(value for name, value in terms.items() if name != "parameter reads"))
    fetches = 4 * (2 * 2 + 3 * 3)  # M x (embedding and head twice, blocks three times)
    with_own, without = zero_terms(workload, own, settings), zero_terms(workload, plain, settings)
    assert with_own["compute"] - without["compute"] == pytest.approx(fetches * 0.01)
    assert with_own["Adam"] == pytest.approx(shape.params / 1e9)
    assert with_own["optimizer step, beyond its parts"] == pytest.approx(shape.params * 3e-10)
    assert "optimizer step, beyond its parts" not in without  # not measured: not modelled
    swapped = sum(n for layer in shape.layers for n in layer.tensor_numels if 4 * n >= MIB)
    assert with_own["gradient write (boundary)"] == pytest.approx(swapped * 2e-9)
    # Parts the probe did not measure keep the aio ops' model.
    assert with_own["optimizer state read"] == pytest.approx(without["optimizer state read"])
    assert with_own["gradient reduction"] == pytest.approx(4 * shape.params / 1e9)
    # embedding and head: one swapped tensor, fetched twice; blocks: four, fetched three times
    assert with_own["parameter reads"] == 4 * (2 * 2 * 1 + 3 * 3 * 4)


def test_hardware_tables_round_trip_and_bad_ones_are_named():
    hardware = machine(ssd_read_seconds_by_op_size={MIB: 0.001}, zero_read_seconds_by_size={2 * MIB: 0.002})
    again = hardware_from_dict(json.loads(json.dumps(hardware.to_dict())))
    assert again.ssd_read_seconds_by_op_size == {MIB: 0.001} and again.zero_read_seconds_by_size == {2 * MIB: 0.002}
    with pytest.raises(PlannerError, match="ssd_write_seconds_by_op_size"):
        machine(ssd_write_seconds_by_op_size={MIB: -1.0})
    with pytest.raises(PlannerError, match="op sizes in bytes"):
        hardware_from_dict(dict(machine().to_dict(), zero_read_seconds_by_size={"1 MiB": 0.1}))
    with pytest.raises(PlannerError, match="zero_seconds_per_fetch"):
        machine(zero_seconds_per_fetch=-0.1)
    with pytest.raises(PlannerError, match="zero_optimizer_seconds_per_element"):
        machine(zero_optimizer_seconds_per_element={"Adam": float("nan")})


def test_settings_read_the_swap_rule_and_sub_groups_as_deepspeed_parses_them():
    default = settings_from_ds_config({})
    assert default.zero.min_swap_bytes == MIB and default.zero.sub_group_size == 1e9
    custom = settings_from_ds_config({"aio": {"block_size": 4 * MIB}, "zero_optimization": {"sub_group_size": 1}})
    assert custom.zero.min_swap_bytes == 4 * MIB and custom.zero.sub_group_size == 1
    horizontal = HorizontalSettings.from_settings(custom)
    assert horizontal.min_swap_bytes == 4 * MIB and horizontal.sub_group_size == 1


def test_the_last_micro_batchs_reduction_has_its_own_cost():
    """ZeRO-3's reduction of the last micro-batch also hands the gradients to the optimizer (0.25 s against 0.10 s
    for the others at hidden 640 here): with the probe's measurement, M - 1 ordinary reductions and one boundary."""
    shape = GPTShape("t", 2, 512, 4, 1024, 16)
    settings = HorizontalSettings(sub_group_size=1)
    hardware = machine(zero_grad_reduce_elements_per_s=1e9,
                       zero_optimizer_seconds_per_element={"gradient reduction (boundary)": 3e-9})
    for m in (1, 4):
        terms = zero_terms(Workload(shape, 1, m), hardware, settings)
        assert terms["gradient reduction"] == pytest.approx(shape.params * ((m - 1) / 1e9 + 3e-9))
    # With a GPU the host link carries the reduction: none in the compute lane, boundary or not.
    on_gpu = machine(host_device_bytes_per_s=1e10, zero_grad_reduce_elements_per_s=1e9,
                     zero_optimizer_seconds_per_element={"gradient reduction (boundary)": 3e-9})
    assert zero_terms(Workload(shape, 1, 4), on_gpu, settings)["gradient reduction"] == 0
