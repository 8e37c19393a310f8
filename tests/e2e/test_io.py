"""SSD traffic: greedysnake reads each layer's parameters once per sweep whatever the number of
micro-batches M; ZeRO-Infinity's horizontal loop reads them again for every micro-batch."""
import pytest

from greedysnake_run import run_greedysnake

pytestmark = pytest.mark.slow


def test_greedysnake_parameter_reads_are_flat_in_micro_batches(tmp_path):
    reads = {}
    for num_micro_batches in (2, 8):
        run = run_greedysnake(str(tmp_path / f"m{num_micro_batches}"), num_micro_batches, steps=2)
        reads[num_micro_batches] = run.metrics[-1].ssd_bytes_read["param"]
        num_layers = len(run.engine.layers)
        # Every layer once per sweep, but layer L-2, resident across the turn, and the last layer, not
        # run in forward.
        assert run.metrics[-1].ssd_reads["param"] == 2 * num_layers - 2
        # Gradients reach the optimizer through host memory by default: none goes to SSD.
        assert run.engine.io_counters.writes["grad"] == 0
    assert abs(reads[8] - reads[2]) <= 0.05 * reads[2]


def test_gradients_go_through_ssd_once_per_step_without_host_memory(tmp_path):
    for num_micro_batches in (2, 8):
        run = run_greedysnake(str(tmp_path / f"m{num_micro_batches}"), num_micro_batches, steps=2,
                              greedysnake={"gradient_host_memory_mb": 0})
        num_layers = len(run.engine.layers)
        # Each layer's gradient leaves once per step, whatever M.
        assert run.engine.io_counters.writes["grad"] == 2 * num_layers
        assert run.metrics[-1].ssd_bytes_read["optimizer_worker"] > run.metrics[-1].ssd_bytes_written["grad"]
