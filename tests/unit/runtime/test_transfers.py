"""The transfer stream's event bookkeeping, run on the CPU with a fake stream whose copies complete only
when something waits for them (or the test says so): what a GPU would do while its copy engine is busy."""
import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn

from ds_greedysnake.storage import transfers
from ds_greedysnake.runtime.activations import ActivationStore, InputGradients
from ds_greedysnake.storage.ssd_layout import LayerLayout
from ds_greedysnake.runtime.layer import BufferPool, LayerOwner, Residency
from ds_greedysnake.runtime.parallel import DataParallel
from ds_greedysnake.storage.ssd import Region, buffer_offsets, round_up
from ds_greedysnake.storage.transfers import Transfers

CPU = torch.device("cpu")


class FakeEvent:
    """A device event: completing it completes every event recorded before it on its stream (a stream runs
    its work in order)."""

    def __init__(self, log):
        self.completed = False
        self._log = log
        self._stream = None

    def record(self, stream):
        self._stream = stream
        stream.recorded.append(self)

    def query(self):
        return self.completed

    def synchronize(self):
        self._log.append(self)
        earlier = self._stream.recorded[:self._stream.recorded.index(self) + 1] if self._stream else [self]
        for event in earlier:
            event.completed = True


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.recorded, self.waited = [], []

    def wait_event(self, event):
        self.waited.append(event)


class FakeStreams:
    """AcceleratorStreams' interface; copies run at once on the CPU, but their events stay pending."""

    def __init__(self):
        self.inbound, self.outbound = FakeStream("inbound"), FakeStream("outbound")
        self.compute = FakeStream("compute")
        self.synchronized = []  # events the CPU waited for, in order
        self.kept_for = []

    def current(self):
        return self.compute

    def on(self, stream):
        return contextlib.nullcontext()

    def record(self, stream):
        event = FakeEvent(self.synchronized)
        event.record(stream)
        return event

    def keep_for(self, tensor, stream):
        self.kept_for.append(stream)


class RecordingTransfers(Transfers):
    """Remembers every copy to the device with the host buffer it reads."""

    def __init__(self, streams, **options):
        super().__init__(CPU, streams, **options)
        self.copies = []  # (host data_ptr, guard)

    def to_device(self, host, consumer=None):
        on_device, guard = super().to_device(host, consumer)
        self.copies.append((host.data_ptr(), guard))
        return on_device, guard


def test_a_copy_to_the_device_is_ordered_on_the_device_and_guards_its_host_buffer():
    streams = FakeStreams()
    copies = Transfers(CPU, streams)
    host = torch.arange(6.0)
    on_device, guard = copies.to_device(host)
    assert torch.equal(on_device, host) and on_device.data_ptr() != host.data_ptr()
    copied = streams.inbound.recorded[-1]
    assert streams.compute.waited == [copied]  # compute waits on the device, the CPU does not
    assert streams.kept_for == [streams.compute] and streams.synchronized == []
    assert not guard.done()
    guard.wait()
    assert streams.synchronized == [copied] and guard.done()


def test_a_copy_to_the_host_waits_for_the_compute_that_produced_it():
    streams = FakeStreams()
    copies = Transfers(CPU, streams)
    produced = torch.randn(5)
    host = torch.empty(5)
    guard = copies.to_host(produced, host)
    assert streams.outbound.waited == [streams.compute.recorded[-1]]
    assert torch.equal(host, produced) and not guard.done()


def test_copies_into_and_from_one_host_buffer_wait_for_each_other_on_the_device():
    streams = FakeStreams()
    copies = Transfers(CPU, streams)
    slot = torch.empty(5)
    copies.to_host(torch.randn(5), slot)
    written = streams.outbound.recorded[-1]
    copies.to_device(slot)
    assert streams.inbound.waited == [written]  # not read before it is written
    read = streams.inbound.recorded[-1]
    copies.to_host(torch.randn(5), slot)
    assert streams.outbound.waited[-1] is read  # not rewritten before it is read
    copies.to_device(torch.empty(5))  # another buffer: no wait
    assert streams.inbound.waited == [written]
    assert streams.synchronized == []  # all of it on the device: the CPU never waited


def test_on_the_cpu_accelerator_nothing_is_copied():
    copies = Transfers(CPU)
    host = torch.arange(4.0)
    on_device, guard = copies.to_device(host)
    assert on_device is host and guard.done()
    parked, guard = copies.host_copy(host)
    assert parked is host and guard.done()


class FakeStore:
    """SsdStore's interface for one layer's parameters; start_read checks the buffer is not being copied."""

    def __init__(self, copies: RecordingTransfers):
        self.copies = copies
        self.data = {}
        self.reads_started = 0
        self._next_id = 0

    def buffer(self, num_bytes):
        return torch.zeros(num_bytes, dtype=torch.uint8)

    def create_region(self, label, payload_bytes, category, file_bytes=None):
        self._next_id += 1
        return Region(self._next_id, label, payload_bytes, category)

    def write(self, region, buffer):
        self.data[region.region_id] = buffer[:region.payload_bytes].clone()

    def start_read(self, region, buffer):
        self.start_read_regions([region], buffer)

    def start_read_regions(self, regions, buffer):
        start, stop = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
        pending = [guard for pointer, guard in self.copies.copies if start <= pointer < stop and not guard.done()]
        assert not pending, "an aio read would overwrite a host buffer a device copy still reads"
        for region, offset in zip(regions, buffer_offsets(regions)):
            buffer[offset:offset + region.payload_bytes].copy_(self.data[region.region_id])
        self.reads_started += 1

    def wait_for_read(self, buffer):
        pass


def test_the_pool_hands_out_a_buffer_only_once_the_copy_reading_it_completed():
    streams = FakeStreams()
    copies = Transfers(CPU, streams)
    pool = BufferPool(FakeStore(None), 4096, count=2)
    first, second = pool.acquire(), pool.acquire()
    _, reading_second = copies.to_device(second)
    pool.give_back(first)
    pool.give_back(second, reading_second)
    assert pool.acquire() is first  # the one whose copy is done, though the other came back last
    assert streams.synchronized == []
    assert pool.acquire() is second  # the only one left: handed out once its copy completed
    assert reading_second.done() and len(streams.synchronized) == 1


def _layers(copies, count, pool_size, frozen_bias=False):
    """``count`` one-Linear layers; ``frozen_bias``: each bias frozen (a layer with both kinds, two copies per
    fetch from one buffer). ``weights``: each layer's parameters in module order."""
    torch.manual_seed(0)
    store = FakeStore(copies)
    parallel = DataParallel(1, 0, CPU)
    layers = []
    for index in range(count):
        module = nn.Linear(8, 8)
        module.bias.requires_grad_(not frozen_bias)
        layer = LayerOwner(index, module, torch.float32, CPU, parallel)
        layer.transfers = copies
        layers.append(layer)
    pool = BufferPool(store, max(layer.read_buffer_bytes for layer in layers), count=pool_size)
    weights = []
    for layer in layers:
        flat, frozen = layer.flat_parameters()
        weights.append(torch.cat([flat, frozen]))
        layer.offload(store, pool, flat, LayerLayout(numel=layer.shard_numel, param_slots=2, state_slots=2,
                                                     gradient_on_ssd=True, param_bytes=layer.shard_bytes,
                                                     gradient_bytes=4 * layer.shard_numel, piece_numel=1 << 22,
                                                     frozen_bytes=layer.frozen_shard_bytes), frozen)
    return layers, store, weights


@pytest.mark.parametrize("frozen_bias", [False, True])
def test_no_aio_read_lands_in_a_buffer_before_the_device_copy_from_it_completed(frozen_bias):
    streams = FakeStreams()
    copies = RecordingTransfers(streams)
    # One buffer for three layers: every read reuses the buffer the previous layer's copies read (with a
    # frozen bias, two copies from one buffer: its trainable part and its frozen part).
    layers, store, weights = _layers(copies, 3, pool_size=1, frozen_bias=frozen_bias)
    for layer, expected in zip(layers, weights):
        layer.prefetch()
        layer.fetch()
        bound = torch.cat([param.data.reshape(-1) for param in layer.module.parameters()])
        assert torch.equal(bound, expected)
        layer.release()
    assert store.reads_started == 3 and len(copies.copies) == 3 * (2 if frozen_bias else 1)
    # Each later read waited for the copies before it, which the CPU did not wait for otherwise.
    assert len(streams.synchronized) == 2


def test_stage_starts_the_copy_that_fetch_then_binds():
    streams = FakeStreams()
    copies = RecordingTransfers(streams)
    layers, _, weights = _layers(copies, 1, pool_size=1)
    layer = layers[0]
    layer.stage()
    assert len(copies.copies) == 1 and layer.state == Residency.READING
    layer.fetch()
    assert len(copies.copies) == 1 and layer.state == Residency.RESIDENT
    assert torch.equal(torch.cat([p.data.reshape(-1) for p in layer.module.parameters()]), weights[0])
    layer.release()
    layer.stage()  # on SSD again: staged from a fresh read, dropped by release
    layer.release()
    assert layer.state == Residency.ON_SSD


def _alive(references):
    return sum(reference() is not None for reference in references)


@pytest.mark.parametrize("num_micro_batches", [3, 12])
def test_input_gradients_held_on_the_device_do_not_grow_with_the_micro_batches(num_micro_batches):
    streams = FakeStreams()
    gradients = InputGradients(CPU, Transfers(CPU, streams, max_pending_to_host=2))
    values, references, peak = [], [], 0
    for micro_batch in range(num_micro_batches):
        gradient = torch.randn(2, 4, 8)
        values.append(gradient.clone())
        references.append(weakref.ref(gradient.untyped_storage()))  # its memory
        gradients.put(micro_batch, gradient)
        del gradient
        peak = max(peak, _alive(references))
    # The latest, the one being parked and the copies in flight (at most 2).
    assert peak <= 3
    for micro_batch in reversed(range(num_micro_batches)):
        assert torch.equal(gradients.take(micro_batch), values[micro_batch])


@pytest.mark.parametrize("num_micro_batches", [3, 12])
def test_checkpoints_held_on_the_device_do_not_grow_with_the_micro_batches(tmp_path, num_micro_batches):
    streams = FakeStreams()
    store = ActivationStore(None, 1 << 30, CPU, transfers=Transfers(CPU, streams, max_pending_to_host=2))
    values, references, peak = [], [], 0
    for micro_batch in range(num_micro_batches):
        hidden = torch.randn(2, 4, 8)
        values.append(hidden.clone())
        references.append(weakref.ref(hidden.untyped_storage()))
        store.put(1, micro_batch, hidden)
        del hidden
        peak = max(peak, _alive(references))
    assert peak <= 3
    for micro_batch in reversed(range(num_micro_batches)):
        assert torch.equal(store.take(1, micro_batch), values[micro_batch])


class RegisteringAccelerator:
    """DeepSpeed's accelerator as transfers.host_buffer sees one that registers host memory (CUDA's)."""

    def __init__(self):
        self.calls = []

    def device_name(self):
        return "cuda"

    def register_host_memory(self, address, num_bytes):
        self.calls.append(("register", address, num_bytes))
        return True

    def unregister_host_memory(self, address):
        self.calls.append(("unregister", address))


def test_host_buffers_are_registered_at_their_size_and_unregistered_with_their_memory(monkeypatch):
    accelerator = RegisteringAccelerator()
    monkeypatch.setattr(transfers, "get_accelerator", lambda: accelerator)
    size = (2 << 20) + 8192 + 100  # the caching host allocator would pin 4 MiB
    buffer = transfers.host_buffer(size)
    address = buffer.data_ptr()
    assert buffer.numel() == size and address % transfers.PAGE_BYTES == 0
    assert accelerator.calls == [("register", address, round_up(size, transfers.PAGE_BYTES))]
    view = buffer[10:20]
    del buffer
    gc.collect()
    assert len(accelerator.calls) == 1, "a view still uses the memory"
    del view
    gc.collect()
    assert accelerator.calls[-1] == ("unregister", address)


def test_a_failed_registration_clears_the_runtime_error_it_left(monkeypatch):
    """cudaHostRegister failing leaves the CUDA runtime's last error set; the next kernel launch's check would
    report it from an unrelated place. The failure is read back (cleared) before the MemoryError is raised."""
    read_back = []

    class FailingCuda:
        def device_name(self):
            return "cuda"

        def register_host_memory(self, address, num_bytes):
            raise RuntimeError("CUDA error: invalid argument")

    class Runtime:
        def cudaGetLastError(self):
            read_back.append(True)
            return 1

    monkeypatch.setattr(transfers, "get_accelerator", lambda: FailingCuda())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    with pytest.raises(MemoryError, match="read back and cleared"):
        transfers.register_host_memory(4096, 4096)
    assert read_back == [True]


def test_guards_of_buffers_never_copied_again_do_not_keep_them_alive():
    streams = FakeStreams()
    copies = Transfers(CPU, streams)
    first = torch.empty(4)
    alive = weakref.ref(first)
    copies.to_device(first)
    streams.inbound.recorded[-1].completed = True  # the device ran it; nobody polled its guard
    del first
    others = [torch.empty(4) for _ in range(2 * transfers._PRUNE_LAST_COPIES_FROM)]
    for other in others:
        copies.to_device(other)
    gc.collect()
    assert alive() is None
