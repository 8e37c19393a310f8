"""A fetch's all-gather over the ranks (layer.py ``_gather_in``, transfers.py ``gather_to_device``): on a stream
of its own, ordered after the shard's copy to the device and not after the compute queued before it; the
compute waits for it on the device when the weights are bound; one collective per fetch, also for a layer
with trainable and frozen parameters, giving the weights two gathers gave.

Run on the CPU with test_transfers.py's fake streams (copies run at once, events stay pending unless waited
for) and a DataParallel of world size 2 whose collective is a double: it records the stream current at the
call and what the gather stream had waited for, and stands in for rank 1 with a fixed function of rank 0's
shard."""
import contextlib

import pytest
import torch
from torch import nn

from ds_greedysnake.runtime import parallel as parallel_module
from ds_greedysnake.runtime.layer import BufferPool, LayerOwner
from ds_greedysnake.runtime.parallel import DataParallel
from ds_greedysnake.storage.ssd_layout import LayerLayout
from test_transfers import CPU, FakeStore, FakeStream, FakeStreams, RecordingTransfers


class StreamContextStreams(FakeStreams):
    """FakeStreams with a gather stream, and the stream whose context the host is in (``on``)."""

    def __init__(self):
        super().__init__()
        self.gather = FakeStream("gather")
        self.active = None

    @contextlib.contextmanager
    def on(self, stream):
        outer, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = outer


class RecordingCollectives:
    """deepspeed.comm's all_gather_into_tensor for world size 2: rank 1's shard is ``2 * shard + 1``."""

    def __init__(self, streams):
        self.streams = streams
        self.gathers = []  # (current stream's name, events the gather stream had waited for, input numel)

    def all_gather_into_tensor(self, output, tensor, group=None):
        streams = self.streams
        current = streams.active.name if streams and streams.active else "compute"
        self.gathers.append((current, list(streams.gather.waited) if streams else [], tensor.numel()))
        output[:tensor.numel()].copy_(tensor)
        output[tensor.numel():].copy_(2 * tensor + 1)


def _layer(copies, frozen_bias, parallel):
    """One Linear layer of world size 2 (this is rank 0), offloaded to a fake store; with ``frozen_bias`` its
    bias is frozen (a trainable and a frozen vector, as a LoRA layer has)."""
    torch.manual_seed(0)
    store = FakeStore(copies)
    module = nn.Linear(8, 6)
    module.bias.requires_grad_(not frozen_bias)
    layer = LayerOwner(0, module, torch.float32, CPU, parallel)
    layer.transfers = copies
    pool = BufferPool(store, layer.read_buffer_bytes, count=2)
    flat, frozen = layer.flat_parameters()
    shard, frozen_shard = layer.layout.own_shard(flat), layer.frozen_layout.own_shard(frozen)
    layer.offload(store, pool, shard, LayerLayout(numel=layer.shard_numel, param_slots=2, state_slots=2,
                                                  gradient_on_ssd=True, param_bytes=layer.shard_bytes,
                                                  gradient_bytes=4 * layer.shard_numel, piece_numel=1 << 22,
                                                  frozen_bytes=layer.frozen_shard_bytes), frozen_shard)
    # What one gather per vector gives (main before this change), through the same recording collective.
    two_gathers = torch.cat([parallel.gather(shard, layer.layout)[:layer.numel],
                             parallel.gather(frozen_shard, layer.frozen_layout)[:layer.frozen_numel]])
    return layer, two_gathers


def _bound(layer):
    """The layer's bound weights, trainable ones first, as the layout orders them."""
    return torch.cat([param.data.reshape(-1) for param in layer.params + layer.frozen_params])


@pytest.fixture
def streams(monkeypatch):
    streams = StreamContextStreams()
    monkeypatch.setattr(parallel_module, "dist", RecordingCollectives(streams))
    return streams


@pytest.mark.parametrize("frozen_bias", [False, True], ids=["trainable only", "trainable and frozen"])
def test_the_gather_runs_on_its_stream_after_the_copy_not_after_the_compute(streams, frozen_bias):
    collectives = parallel_module.dist
    copies = RecordingTransfers(streams)
    layer, two_gathers = _layer(copies, frozen_bias, DataParallel(2, 0, CPU))
    collectives.gathers.clear()
    earlier_compute = streams.record(streams.compute)  # the previous layer's compute, queued before the stage
    layer.prefetch()
    layer.stage()
    later_compute = streams.record(streams.compute)  # compute queued after the stage, before the fetch
    copied = streams.inbound.recorded[-1]
    assert len(copies.copies) == 1, "one copy to the device per fetch"
    assert collectives.gathers == [("gather", [copied], collectives.gathers[0][2])], "one gather, on its stream"
    gathered = streams.gather.recorded[-1]
    assert gathered not in streams.compute.waited, "compute waits for the gather only when the weights are bound"
    layer.fetch()
    assert streams.compute.waited == [gathered]  # on the device; not on the copy, which the gather waited for
    assert earlier_compute not in streams.gather.waited and later_compute not in streams.gather.waited
    assert streams.synchronized == [], "the host waited for nothing"
    # The copy is kept for the gather stream, the gathered weights for the compute stream.
    assert streams.kept_for[0] is streams.gather and set(streams.kept_for[1:]) == {streams.compute}
    assert torch.equal(_bound(layer), two_gathers)  # bitwise: a gather is a copy
    layer.release()


def test_on_the_cpu_accelerator_one_gather_per_fetch_gives_the_two_gathers_weights(monkeypatch):
    collectives = RecordingCollectives(None)
    monkeypatch.setattr(parallel_module, "dist", collectives)
    layer, two_gathers = _layer(RecordingTransfers(None), True, DataParallel(2, 0, CPU))  # the device is the host
    collectives.gathers.clear()
    for _ in range(2):
        layer.prefetch()
        layer.fetch()
        assert torch.equal(_bound(layer), two_gathers)
        layer.release()
    # One collective per fetch, on the host (no streams), taking the trainable and the frozen shard at once.
    assert [(current, waited) for current, waited, _ in collectives.gathers] == [("compute", [])] * 2
    assert all(numel > layer.layout.shard_numel for _, _, numel in collectives.gathers)
