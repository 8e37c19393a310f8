"""The update pipeline: piece ranges, and queued updates run earliest deadline (lowest layer) first."""
import torch

from ds_greedysnake.deepspeed_compat import AdamHyperparameters, CpuAdamKernel
from ds_greedysnake.host_memory import HostArena, SharedHostMemory
from ds_greedysnake.ssd import Region
from ds_greedysnake.update_pipeline import UpdatePipeline, piece_ranges
from ds_greedysnake.updates import UpdateTask

HYPER = AdamHyperparameters(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)


def test_piece_ranges_cover_the_layer_once():
    assert piece_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert piece_ranges(8, 4) == [(0, 4), (4, 8)]
    assert piece_ranges(3, 4) == [(0, 3)]


class RecordingStore:
    """Stands in for SsdStore: records the writes, completes everything at once."""

    def __init__(self):
        self.written = []

    def start_write(self, region, buffer):
        self.written.append(region.path)

    def start_read(self, region, buffer):
        raise AssertionError("host-memory states and gradients need no read")

    def wait(self):
        pass


class Buffers:
    pieces, grad = [], None

    def __init__(self, numel):
        self.params = torch.empty(4 * numel, dtype=torch.uint8)


def test_queued_updates_run_lowest_layer_first_after_the_started_one():
    numels = [64] * 8
    host = SharedHostMemory(HostArena.for_gradients(numels, 1 << 20),
                            HostArena.for_optimizer_states(numels, 8, 1 << 20))
    for layer in range(8):
        host.optimizer_states.slot(layer, 3 * 64).zero_()
        host.gradients.slot(layer, 64).fill_(1.0)
    store = RecordingStore()
    pipeline = UpdatePipeline(store, CpuAdamKernel(HYPER, adamw_mode=True), Buffers(64), host)
    for task_id, layer in enumerate([5, 3, 7, 1]):
        pipeline.add(UpdateTask(task_id, layer, 64, torch.float32, None, None, 64, None,
                                Region(task_id, f"param{layer}", 256, "param"), 1, HYPER, 1.0))
    results = pipeline.drain()
    # Layer 5's update had started when the others came; then the next forward's order.
    assert store.written == ["param5", "param1", "param3", "param7"]
    assert [result.task_id for result in results] == [0, 3, 1, 2]
    assert pipeline.idle()
    # Adam moved every master: lr 1e-2 against a gradient of ones.
    assert torch.allclose(host.optimizer_states.slot(1, 64), torch.full((64,), -1e-2))
    host.close()
