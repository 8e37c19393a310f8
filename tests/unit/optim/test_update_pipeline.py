"""The update pipeline: piece ranges, queued updates run earliest deadline (lowest layer) first, and
states read ahead while it idles, and the writes kept in flight over the next piece's Adam."""
import copy
import time

import torch

from ds_greedysnake.deepspeed_compat import AdamHyperparameters, AioSettings, CpuAdamKernel
from ds_greedysnake.storage.host_memory import HostArena, SharedHostMemory
from ds_greedysnake.storage.io_trace import WORKER, IoRecorder
from ds_greedysnake.storage.ssd import IoCounters, Region, SsdStore, padded_size
from ds_greedysnake.optim.update_pipeline import ReadAheadPiece, UpdateBuffers, UpdatePipeline, piece_ranges
from ds_greedysnake.optim.updates import UpdateTask, plan_write

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

    wait_reads = wait_writes = wait


class Buffers:
    pieces, grad = [], None

    def __init__(self, numel):
        self.params = [torch.empty(4 * numel, dtype=torch.uint8) for _ in range(2)]


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


# ---------------------------------------------------------------- reading ahead (real SSD regions)

NUMEL = 1000


class SsdLayers:
    """Two layers with states on SSD (two slots, one piece each), gradients in host memory."""

    def __init__(self, folder, read_ahead_pieces):
        self.store = SsdStore(str(folder), AioSettings(), IoCounters(), "t")
        self.host = SharedHostMemory(HostArena.for_gradients([NUMEL] * 2, 1 << 20),
                                     HostArena.for_optimizer_states([NUMEL] * 2, 0, 0))
        self.slots = [[self.store.create_region(f"opt_l{layer}_s{slot}", 12 * NUMEL, "optimizer") for slot in (0, 1)]
                      for layer in range(2)]
        self.params = [self.store.create_region(f"param_l{layer}", 4 * NUMEL, "param") for layer in range(2)]
        staging = self.store.buffer(padded_size(12 * NUMEL))
        generator = torch.Generator().manual_seed(0)
        for layer in range(2):
            staging[:12 * NUMEL].view(torch.float32).copy_(torch.randn(3 * NUMEL, generator=generator).abs())
            self.store.write(self.slots[layer][0], staging)
            self.host.gradients.slot(layer, NUMEL).copy_(torch.randn(NUMEL, generator=generator))
        self.pipeline = UpdatePipeline(self.store, CpuAdamKernel(HYPER, adamw_mode=True),
                                       UpdateBuffers(self.store, NUMEL, NUMEL, 0, read_ahead_pieces), self.host)

    def hint(self, layers):
        self.pipeline.hint([ReadAheadPiece(layer, 0, copy.copy(self.slots[layer][0])) for layer in layers])

    def task(self, task_id, layer):
        return UpdateTask(task_id, layer, NUMEL, torch.float32, [self.slots[layer][0]],
                          [plan_write(self.slots[layer][1])], NUMEL, None, plan_write(self.params[layer]), 1, HYPER, 1.0)

    def results(self, layers=(0, 1)):
        """The new states of ``layers``, as written."""
        buffer = self.store.buffer(padded_size(12 * NUMEL))
        states = []
        for layer in layers:
            self.store.read(self.slots[layer][1], buffer)
            states.append(buffer[:12 * NUMEL].view(torch.float32).clone())
        return states


def test_pieces_read_ahead_are_used_and_give_the_same_update(tmp_path):
    reference = SsdLayers(tmp_path / "reference", read_ahead_pieces=0)
    for task_id, layer in enumerate([1, 0]):
        reference.pipeline.add(reference.task(task_id, layer))
    reference_results = reference.pipeline.drain()

    layers = SsdLayers(tmp_path / "ahead", read_ahead_pieces=2)
    layers.hint([1, 0])
    reads_before = layers.store.counters.reads["optimizer"]
    assert layers.pipeline.read_ahead() and layers.pipeline.read_ahead()
    assert not layers.pipeline.read_ahead()  # both spare buffers hold a piece
    assert layers.store.counters.reads["optimizer"] == reads_before + 2
    for task_id, layer in enumerate([1, 0]):
        layers.pipeline.add(layers.task(task_id, layer))
    results = layers.pipeline.drain()
    assert layers.store.counters.reads["optimizer"] == reads_before + 2  # no state read again
    # The same bits, and the bytes read ahead are counted with the update that used them.
    assert all(torch.equal(a, b) for a, b in zip(layers.results(), reference.results()))
    assert [r.bytes_read for r in results] == [r.bytes_read for r in reference_results]


def test_a_stale_piece_read_ahead_is_dropped_and_read_again(tmp_path):
    layers = SsdLayers(tmp_path, read_ahead_pieces=1)
    layers.hint([1])
    assert layers.pipeline.read_ahead()
    # The committed states are rewritten after the read (as loading a checkpoint does).
    staging = layers.store.buffer(padded_size(12 * NUMEL))
    staging[:12 * NUMEL].view(torch.float32).fill_(0.5)
    layers.store.write(layers.slots[1][0], staging)
    reads_before = layers.store.counters.reads["optimizer"]
    layers.pipeline.add(layers.task(0, 1))
    (result,) = layers.pipeline.drain()
    assert layers.store.counters.reads["optimizer"] == reads_before + 1
    # Adam started from the rewritten master (0.5), not from the piece read ahead.
    (states,) = layers.results(layers=(1,))
    master = states[:NUMEL]
    assert torch.allclose(master, torch.full((NUMEL,), 0.5), atol=2e-2)
    # Both reads were made: both are counted.
    assert result.bytes_read == 2 * padded_size(12 * NUMEL)


def test_read_ahead_waits_for_idle_and_can_be_cancelled(tmp_path):
    layers = SsdLayers(tmp_path, read_ahead_pieces=2)
    layers.pipeline.add(layers.task(0, 0))
    layers.hint([1])
    assert not layers.pipeline.read_ahead()  # an update is in flight: its states are not final yet
    layers.pipeline.drain()
    assert layers.pipeline.read_ahead()
    layers.pipeline.cancel_read_ahead()
    reads_before = layers.store.counters.reads["optimizer"]
    layers.pipeline.add(layers.task(1, 1))
    layers.pipeline.drain()
    assert layers.store.counters.reads["optimizer"] == reads_before + 1


def test_the_writes_of_one_piece_stay_in_flight_over_the_next_pieces_adam(tmp_path):
    """Read(i+1) goes out before Adam(i), and write(i-1) is waited for only after it: while Adam runs,
    the SSD has a read and a write to serve. The same bits as waiting for everything before Adam."""
    layers = SsdLayers(tmp_path / "overlapped", read_ahead_pieces=0)
    recorder = IoRecorder(WORKER)
    layers.store.recorder = recorder
    kernel_update = layers.pipeline._kernel.update

    def update(*args):
        recorder.span("adam", time.monotonic())
        return kernel_update(*args)

    layers.pipeline._kernel.update = update
    recorder.start()
    for task_id, layer in enumerate([0, 1]):
        layers.pipeline.add(layers.task(task_id, layer))
    layers.pipeline.drain()
    events = recorder.stop()
    order = [(e.kind, e.op, e.path.rsplit("_", 1)[-1] if e.path else "", e.handles) for e in events]
    second_adam = [i for i, e in enumerate(events) if e.kind == "span"][1]
    first_state_write = next(i for i, e in enumerate(events)
                             if e.kind == "issue" and e.op == "write" and e.path == layers.slots[0][1].path)
    waited = next(i for i, e in enumerate(events) if i > first_state_write and e.kind == "wait" and "w" in e.handles)
    assert first_state_write < second_adam < waited, order
    # Layer 1's read was in flight during layer 0's Adam.
    second_read = next(i for i, e in enumerate(events)
                       if e.kind == "issue" and e.op == "read" and e.path == layers.slots[1][0].path)
    first_adam = [i for i, e in enumerate(events) if e.kind == "span"][0]
    assert second_read < first_adam, order

    # The same new states as two updates run one after the other with nothing in flight over Adam.
    reference = SsdLayers(tmp_path / "serial", read_ahead_pieces=0)
    for task_id, layer in enumerate([0, 1]):
        reference.pipeline.add(reference.task(task_id, layer))
        reference.pipeline.drain()
    assert all(torch.equal(a, b) for a, b in zip(layers.results(), reference.results()))
