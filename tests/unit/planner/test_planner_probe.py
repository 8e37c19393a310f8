"""The planner's SSD probe on tiny transfers: its mechanics (every rate measured, positive, its files
removed), not the rates themselves, which a loaded machine moves."""
import os

import pytest

from ds_greedysnake.deepspeed_compat import AioSettings
from ds_greedysnake.planner.errors import PlannerError
from ds_greedysnake.planner.probe import _fit_line, probe_ssd

MIB = 2**20

RATE_KEYS = ("ssd_read_bytes_per_s", "ssd_write_bytes_per_s", "ssd_read_bytes_per_s_single",
             "ssd_write_bytes_per_s_single")


def test_ssd_probe_on_tiny_transfers(tmp_path):
    folder = tmp_path / "ssd"
    rates = probe_ssd(str(folder), AioSettings(), region_mib=1, repeats=1)
    assert set(rates) == set(RATE_KEYS) | {"ssd_read_seconds_per_transfer", "ssd_write_seconds_per_transfer"}
    assert all(rates[key] > 0 for key in RATE_KEYS), rates
    assert rates["ssd_read_seconds_per_transfer"] >= 0 and rates["ssd_write_seconds_per_transfer"] >= 0
    assert os.listdir(folder) == []  # its scratch folder is gone


def test_probe_line_fit_ignores_a_few_disturbed_transfers():
    """The SSD probe's fixed cost per transfer and rate: a line through timings of several sizes that a
    few transfers slowed by the disk do not tilt."""
    rate, fixed = 2000 * MIB, 0.002
    points = [(size * MIB, fixed + size * MIB / rate) for size in (16, 21, 32, 64) for _ in range(3)]
    points[1] = (points[1][0], 3 * points[1][1])     # two transfers three times slower
    points[-1] = (points[-1][0], 3 * points[-1][1])
    slope, intercept = _fit_line(points)
    assert 1 / slope == pytest.approx(rate) and intercept == pytest.approx(fixed)
    with pytest.raises(PlannerError, match="at least two sizes"):
        _fit_line([(MIB, 0.1), (MIB, 0.2)])


def test_engine_threads_slowdown_is_taken_over_the_layer_times_own_block(monkeypatch):
    """The engine's threads' slow-down divides the block at the training threads by the all-threads timing
    the layer times hold (passed in), not by a second timing of its own: the engine's block is then
    predicted at exactly what the training threads measured."""
    import torch

    from ds_greedysnake.planner import probe
    from ds_greedysnake.planner.hardware import LayerTimes
    from ds_greedysnake.planner.shapes import parse_layers
    from ds_greedysnake.planner.cost_model import Workload
    from ds_greedysnake.settings import settings_from_ds_config

    calls = []

    def fake_layers(workload, device, repeats=5, kinds=("embedding", "block", "head")):
        calls.append((torch.get_num_threads(), repeats))
        return {"block": LayerTimes(0.01, 0.03 if torch.get_num_threads() == 1 else 0.02)}

    monkeypatch.setattr(probe, "probe_layers", fake_layers)
    monkeypatch.setattr(probe, "training_threads_for", lambda block, device_type: 1)
    monkeypatch.setattr(probe, "worker_threads_for", lambda block, device_type: 1)
    settings = settings_from_ds_config({"train_micro_batch_size_per_gpu": 1})
    workload = Workload(parse_layers("blocks=2,hidden=64,heads=2,vocab=128,seq_len=8"), 1, 1)
    threads = torch.get_num_threads()
    slowdown, sharing = probe.probe_engine_cores(workload, torch.device("cpu"), settings, repeats=3,
                                                 all_threads_block_s=0.015)
    assert torch.get_num_threads() == threads  # restored
    assert slowdown == 0.03 / 0.015  # over the timing passed in, not the fake's all-threads 0.02
    assert sharing == 1.0  # the fake takes as long beside the worker's stand-in as alone
    assert calls[0] == (1, 6)  # the training threads' block timed with twice the repeats, and no all-threads timing
    assert all(count == 1 for count, _ in calls)
    calls.clear()
    slowdown, _ = probe.probe_engine_cores(workload, torch.device("cpu"), settings, repeats=3)
    assert calls[0][0] == threads and slowdown == (0.03 / 0.02 if threads > 1 else 1.0)  # its own timing without one
