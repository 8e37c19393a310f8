"""The planner's probes of ZeRO-3 (issue 33): its aio ops by size into locked buffers, and ZeRO-3 itself on a
few blocks, whose parameter reads must be exactly the tensors the cost model says ZeRO-3 swaps. Mechanics
and what was read, never the timings, which a loaded machine moves."""
import os

import pytest

from ds_greedysnake.deepspeed_compat import AioSettings
from ds_greedysnake.planner.cost_model import Workload
from ds_greedysnake.planner.zero_model import HorizontalSettings, zero_swapped_tensors
from ds_greedysnake.planner.errors import PlannerError
from ds_greedysnake.planner.shapes import GPTShape
from ds_greedysnake.planner.zero_probe import (mean_terms, probe_zero_engine, probe_zero_ops, reduction_parts,
                                              zero_op_sizes)
from ds_greedysnake.settings import settings_from_ds_config

MIB = 2**20


def zero_infinity_config(folder: str, largest: int, sub_group_size: int = 1) -> dict:
    """ZeRO-3 with parameters and optimizer states on NVMe, as scripts/bench/ab_bench runs its baseline."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0,
                "sub_group_size": sub_group_size,
                "offload_param": {"device": "nvme", "nvme_path": folder, "max_in_cpu": 0, "pin_memory": False,
                                  "buffer_count": 5, "buffer_size": largest},
                "offload_optimizer": {"device": "nvme", "nvme_path": folder, "pin_memory": False}},
            "aio": {"block_size": MIB, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                    "overlap_events": True}}


def test_zero_ops_are_timed_at_each_size_and_leave_nothing(tmp_path):
    folder = tmp_path / "ssd"
    rates = probe_zero_ops(str(folder), AioSettings(), [MIB, 3 * MIB, 3 * MIB + 5], min_seconds=0.0)
    sizes = [MIB, 3 * MIB, 3 * MIB + 4096]  # aligned up to aio's 4 KiB
    for kind in ("read", "write"):
        table = rates[f"ssd_{kind}_seconds_by_op_size"]
        assert sorted(table) == sizes and all(seconds > 0 for seconds in table.values())
        assert rates[f"ssd_{kind}_bytes_per_s_single"] == pytest.approx(sizes[-1] / table[sizes[-1]])
    assert os.listdir(folder) == []


def test_op_sizes_are_the_models_swapped_tensors_and_sub_groups():
    shape = GPTShape("t", 2, 512, 4, 1024, 16)
    settings = settings_from_ds_config(zero_infinity_config("/tmp", 4 * 512 * 512))
    reads, writes = zero_op_sizes(Workload(shape, 1, 2), settings)
    # sub_group_size 1: each tensor its own group; those of at least 1 MiB are swapped, in fp32
    expected = sorted({4 * n for layer in shape.layers for n in layer.tensor_numels if 4 * n >= MIB})
    assert reads == writes == expected


@pytest.mark.slow
def test_zero_probe_runs_zero_3_and_reads_the_tensors_the_model_swaps(tmp_path):
    shape = GPTShape("t", 2, 512, 4, 1024, 16)
    ds_config = zero_infinity_config(str(tmp_path), 4 * 512 * 512)
    terms = probe_zero_engine(ds_config, Workload(shape, 1, 2), str(tmp_path), blocks=2, processes=2)
    assert terms["processes"] == 2  # two children, their terms averaged
    assert terms["zero_seconds_per_fetch"] >= 0
    assert terms["zero_grad_reduce_elements_per_s"] > 0
    assert set(terms["zero_optimizer_seconds_per_element"]) == {"gradient reduction (boundary)",
        "optimizer state read", "Adam", "parameter write", "optimizer state write", "gradient write (boundary)",
        "optimizer step, beyond its parts"}
    parts = terms["zero_reduction_parts_seconds_per_element"]  # the reduction's parts, from both processes
    assert set(parts) == {"reduce-scatter", "partition copies", "rest", "norm (boundary)"}
    assert parts["reduce-scatter"] > 0 and parts["partition copies"] > 0 and parts["norm (boundary)"] > 0
    assert parts["rest"] >= 0  # the parts are inside the reduction's own wall time
    zero = HorizontalSettings.from_settings(settings_from_ds_config(ds_config))
    swapped = {4 * n for layer in shape.layers for n in zero_swapped_tensors(layer, 4, zero)}
    assert set(terms["zero_read_seconds_by_size"]) == swapped, "ZeRO-3 read other tensors than the 1 MiB rule says"
    assert os.listdir(tmp_path) == []  # its scratch folder, with ZeRO-3's swap files, is gone


@pytest.mark.slow
def test_a_zero_probe_that_fails_says_why(tmp_path):
    ds_config = zero_infinity_config(str(tmp_path), 1024)  # buffers too small for any swapped tensor
    with pytest.raises(PlannerError, match="the ZeRO-3 probe failed"):
        probe_zero_engine(ds_config, Workload(GPTShape("t", 2, 512, 4, 1024, 16), 1, 2), str(tmp_path), blocks=2)


def test_a_reduction_is_split_into_its_parts_per_element():
    """A step's reductions (M=2 of 100 elements) as profile_zero_step times them, inclusive: the partition holds
    the boundary's norms and gradient write, which leave it; the rest is what neither part holds."""
    ops = {"gradient reduction": 1.0, "gradient reduce-scatter": 0.4, "gradient partition": 0.5,
           "gradient norm (boundary)": 0.1, "gradient write (boundary)": 0.2}
    assert reduction_parts(ops, 2, 100) == pytest.approx({"reduce-scatter": 0.4 / 200, "partition copies": 0.2 / 200,
                                                          "rest": 0.1 / 200, "norm (boundary)": 0.1 / 100})


def _terms(fetch, reduce_rate, state_read, read_4mib):
    return {"zero_seconds_per_fetch": fetch, "zero_grad_reduce_elements_per_s": reduce_rate,
            "zero_optimizer_seconds_per_element": {"optimizer state read": state_read, "Adam": 1e-9},
            "zero_read_seconds_by_size": {4 * MIB: read_4mib}, "passes_seconds": 1.0, "plain_compute_seconds": 0.5,
            "fetches": 12}


def test_several_probe_processes_give_each_cost_as_the_mean_of_theirs():
    """A process's ZeRO-3 state reads ran at one of two speeds on the project's VM: the terms of several
    processes are their mean costs (seconds per element, per fetch, per read), the reduction rate the one
    of their mean seconds per element."""
    fast, slow = _terms(0.002, 4e8, 7e-9, 0.003), _terms(0.0, 2e8, 12e-9, 0.005)
    assert mean_terms([fast]) is fast
    both = mean_terms([fast, slow])
    assert both["processes"] == 2 and both["fetches"] == 12
    assert both["zero_seconds_per_fetch"] == pytest.approx(0.001)
    assert both["zero_grad_reduce_elements_per_s"] == pytest.approx(1 / ((1 / 4e8 + 1 / 2e8) / 2))
    assert both["zero_optimizer_seconds_per_element"] == pytest.approx({"optimizer state read": 9.5e-9, "Adam": 1e-9})
    assert both["zero_read_seconds_by_size"] == pytest.approx({4 * MIB: 0.004})


def test_a_probe_in_no_process_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(PlannerError, match="at least one process, got 0"):
        probe_zero_engine({}, Workload(GPTShape("t", 2, 512, 4, 1024, 16), 1, 2), str(tmp_path), processes=0)
    assert os.listdir(tmp_path) == []
