import contextlib
from types import SimpleNamespace

import pytest
import torch

from ds_greedysnake.deepspeed_compat import AioSettings
from ds_greedysnake.storage import transfers as transfers_module
from ds_greedysnake.runtime.activations import ActivationStore, InputGradients
from ds_greedysnake.storage.ssd import IoCounters, Region, SsdIoError, SsdStore
from ds_greedysnake.storage.ssd_layout import padded_size
from ds_greedysnake.storage.transfers import Transfers

CPU = torch.device("cpu")


@pytest.mark.parametrize("staging_buffers", [1, 4])
@pytest.mark.parametrize("budget_bytes", [0, 3 * 4096, 1 << 30])
def test_checkpoints_come_back_exactly_whatever_the_budget(tmp_path, budget_bytes, staging_buffers):
    counters = IoCounters()
    store = ActivationStore(SsdStore(str(tmp_path), AioSettings(), counters, "act"), budget_bytes, torch.device("cpu"),
                            staging_buffers=staging_buffers)
    tensors = {(layer, mb): torch.randn(2, 16, 32) for layer in (1, 2) for mb in range(3)}
    for key, tensor in tensors.items():
        store.put(*key, tensor)
    assert store.host_bytes <= budget_bytes
    assert torch.equal(store.peek(1, 0), tensors[(1, 0)])
    for key in sorted(tensors, reverse=True):
        assert torch.equal(store.take(*key), tensors[key])
    assert store.host_bytes == 0
    store.clear()  # the step's end: the writes still in flight complete
    spilled = counters.writes["activation"]
    assert (spilled == 0) == (budget_bytes >= 6 * 2 * 16 * 32 * 4)
    # Each spilled checkpoint is read back once, except the last one put, which is still on the
    # device (the snake hand-off); peek(1, 0) reads once more when (1, 0) was spilled.
    # With several staging buffers, some come back from the buffer they were spilled through instead.
    last_put_on_device = 1 if spilled else 0
    peek_read = 1 if budget_bytes == 0 else 0
    read_from_ssd = spilled - last_put_on_device + peek_read
    if staging_buffers == 1:
        assert counters.reads["activation"] == read_from_ssd
    else:
        assert counters.reads["activation"] <= read_from_ssd


def test_bf16_checkpoints_spill(tmp_path):
    store = ActivationStore(SsdStore(str(tmp_path), AioSettings(), IoCounters(), "act"), 0, torch.device("cpu"))
    tensor = torch.randn(3, 5, 7).to(torch.bfloat16)
    store.put(1, 0, tensor)
    store.put(1, 1, tensor + 1)
    assert torch.equal(store.take(1, 0), tensor)
    assert torch.equal(store.take(1, 1), tensor + 1)


# ----------------------------------------------------------------------------- the spill ring's staging buffers


class LazyStore:
    """SsdStore's interface as the activation store uses it, with an asynchronous store's timing made visible:
    a write takes its buffer's bytes when it completes (a buffer reused before would write the new bytes); a
    read takes the region's bytes when it starts and puts them into its buffer when it completes (a read
    started before the region's write completed gets old bytes; a buffer reused meanwhile is overwritten).
    It refuses what the activation store must never do: a transfer into or from a buffer with one in flight,
    a read or a write of a region (a file) with one in flight, a region replaced while one is."""

    def __init__(self, folder, fail_writes=False):
        self.folder, self.name = str(folder), "act"
        self.on_disk, self.pending, self.log = {}, [], []
        self.fail_writes = fail_writes
        self._next_id = 0

    def create_region(self, label, payload_bytes, category):
        path = f"{self.folder}/{label}.bin"
        assert not any(t[1].path == path for t in self.pending), f"{path} replaced while in flight"
        self._next_id += 1
        return Region(self._next_id, path, payload_bytes, category)

    def buffer(self, num_bytes):
        self.log.append(("buffer", num_bytes))
        return torch.zeros(num_bytes, dtype=torch.uint8)

    def free_buffer(self, buffer):
        self.log.append(("free", buffer.numel()))

    def _check_free(self, region, buffer):
        assert not any(t[2] is buffer for t in self.pending), "a buffer reused with a transfer of it in flight"
        assert not any(t[1].path == region.path for t in self.pending), f"{region.path} in flight already"

    def start_write(self, region, buffer):
        self._check_free(region, buffer)
        self.log.append(("write", region.path))
        self.pending.append(("write", region, buffer, None))

    def start_read(self, region, buffer):
        self._check_free(region, buffer)
        self.log.append(("read", region.path))
        self.pending.append(("read", region, buffer, self.on_disk.get(region.path)))

    def in_flight(self, buffer, kind):
        return any(t[0] == kind and t[2] is buffer for t in self.pending)

    def _complete(self, transfers):
        self.pending = [t for t in self.pending if all(t is not done for done in transfers)]
        for kind, region, buffer, read_bytes in transfers:
            self.log.append((f"{kind} done", region.path))
            if kind == "write":
                if self.fail_writes:
                    raise SsdIoError(5, f"aio completed 0 of 1 ops (write {region.path})")
                self.on_disk[region.path] = buffer[:region.payload_bytes].clone()
            else:
                buffer[:region.payload_bytes] = read_bytes

    def wait(self):
        self._complete(list(self.pending))

    def wait_writes(self):
        self._complete([t for t in self.pending if t[0] == "write"])

    def wait_for_read(self, buffer):
        self._complete([t for t in self.pending if t[0] == "read" and t[2] is buffer])


class PendingEvent:
    """A device event that completes only when the host waits for it (or the test says so)."""

    def __init__(self, waited):
        self.completed, self._waited = False, waited

    def record(self, stream):
        pass

    def query(self):
        return self.completed

    def synchronize(self):
        self._waited.append(self)
        self.completed = True


class PendingStreams:
    """AcceleratorStreams' interface: copies run at once on the CPU, their events stay pending."""

    def __init__(self):
        self.waited, self.recorded = [], []
        self.inbound = self.outbound = self.compute = SimpleNamespace(wait_event=lambda event: None)

    def current(self):
        return self.compute

    def on(self, stream):
        return contextlib.nullcontext()

    def record(self, stream):
        event = PendingEvent(self.waited)
        self.recorded.append(event)
        return event

    def keep_for(self, tensor, stream):
        pass


def lazy_activations(tmp_path, buffers, device_streams=None, **store_options):
    store = LazyStore(tmp_path, **store_options)
    transfers = Transfers(CPU, device_streams) if device_streams else Transfers(CPU)
    return store, ActivationStore(store, 0, CPU, transfers=transfers, staging_buffers=buffers)


def test_a_staging_buffer_is_reused_only_after_its_copy_and_its_write(tmp_path):
    streams = PendingStreams()
    store, activations = lazy_activations(tmp_path, 1, streams)
    first, second = torch.randn(4, 8), torch.randn(4, 8)
    activations.put(1, 0, first)
    activations.poll()
    assert not any(entry[0] == "write" for entry in store.log), "a write started before its copy was seen done"
    copy_of_first = streams.recorded[-1]
    activations.put(1, 1, second)  # the one buffer: the first copy waited for, then its write started and completed
    assert copy_of_first in streams.waited
    assert [entry for entry in store.log if entry[0].startswith("write")] == [
        ("write", f"{tmp_path}/act_l1_m0.bin"), ("write done", f"{tmp_path}/act_l1_m0.bin")]
    activations.put(1, 2, torch.randn(4, 8))  # on the device now: the others come back from the SSD
    assert torch.equal(activations.take(1, 1), second)
    assert torch.equal(activations.take(1, 0), first)
    activations.clear()


def test_a_checkpoint_whose_write_is_in_flight_is_read_from_its_buffer(tmp_path):
    store, activations = lazy_activations(tmp_path, 2)
    values = {micro_batch: torch.randn(3, 5) for micro_batch in range(4)}
    path = f"{tmp_path}/act_l1_m{{}}.bin".format
    activations.put(1, 0, values[0])
    activations.put(1, 1, values[1])
    assert {t[1].path for t in store.pending if t[0] == "write"} == {path(0), path(1)}
    # Their writes are in flight: their bytes come from their buffers, the regions are not read.
    assert torch.equal(activations.peek(1, 1), values[1])
    assert torch.equal(activations.take(1, 0), values[0])
    assert not any(entry[0] == "read" for entry in store.log)
    # Two more spills take both buffers (each waits for the writes first); (1, 1) is read after its write.
    activations.put(1, 2, values[2])
    activations.put(1, 3, values[3])
    assert torch.equal(activations.take(1, 1), values[1])
    assert store.log.index(("write done", path(1))) < store.log.index(("read", path(1)))
    activations.clear()


@pytest.mark.parametrize("seed", range(4))
def test_random_puts_peeks_and_takes_keep_every_invariant(tmp_path, seed):
    """Whatever the order of puts, peeks and takes, with or without an announced order: the bytes come back
    exact and the store never sees a buffer or a region reused while in flight (LazyStore refuses it)."""
    generator = torch.Generator().manual_seed(seed)
    store, activations = lazy_activations(tmp_path, 1 + seed % 3, PendingStreams() if seed % 2 else None)
    keys = [(layer, micro_batch) for layer in (1, 2, 3) for micro_batch in range(3)]
    values = {key: torch.randn(2, 3 + key[1], generator=generator) for key in keys}
    if seed >= 2:
        activations.expect_reads([keys[int(i)] for i in torch.randperm(len(keys), generator=generator)])
    for key in keys:
        activations.put(*key, values[key])
        activations.poll()
    for index in torch.randperm(len(keys), generator=generator).tolist():
        key = keys[index]
        if index % 2:
            assert torch.equal(activations.peek(*key), values[key]), key
        assert torch.equal(activations.take(*key), values[key]), key
        activations.poll()
    activations.clear()
    assert not store.pending


def test_spilled_checkpoints_are_read_ahead_in_the_announced_order(tmp_path):
    store, activations = lazy_activations(tmp_path, 3)
    order = [(1, micro_batch) for micro_batch in reversed(range(6))]
    activations.expect_reads(order)
    values = {key: torch.randn(4, 4) for key in order}
    for key in reversed(order):
        activations.put(*key, values[key])
    path = f"{tmp_path}/act_l1_m{{}}.bin".format
    for key in order:
        if key[1] <= 2:  # not in a buffer: read from the SSD, started before its turn
            assert ("read", path(key[1])) in store.log, (key, store.log)
        assert torch.equal(activations.take(*key), values[key])
    # The three spilled last are in the buffers at the turn (the last also on the device); the others are
    # read, in the announced order.
    assert [entry[1] for entry in store.log if entry[0] == "read"] == [path(2), path(1), path(0)]
    activations.clear()


def test_clear_leaves_no_transfer_in_flight(tmp_path):
    store, activations = lazy_activations(tmp_path, 3)
    order = [(1, micro_batch) for micro_batch in reversed(range(4))]
    activations.expect_reads(order)
    values = {key: torch.randn(8) for key in order}
    for key in reversed(order):
        activations.put(*key, values[key])
    for key in order[:2]:
        assert torch.equal(activations.take(*key), values[key])
    assert {t[0] for t in store.pending} == {"read", "write"}  # (1, 0) read ahead, (1, 3)'s write
    activations.clear()
    assert not store.pending
    # And the store is usable again: the next step's regions are written and read as before.
    activations.put(1, 0, torch.ones(8))
    activations.put(1, 1, torch.zeros(8))
    assert torch.equal(activations.take(1, 0), torch.ones(8))
    activations.clear()


def test_a_failed_write_raises_naming_its_file_and_leaves_nothing_in_flight(tmp_path):
    store, activations = lazy_activations(tmp_path, 1, fail_writes=True)
    activations.put(1, 0, torch.randn(8))
    with pytest.raises(SsdIoError, match=r"act_l1_m0\.bin"):
        activations.put(1, 1, torch.randn(8))  # reuses the buffer: waits for the write, which failed
    activations.clear()
    assert not store.pending
    activations.put(1, 0, torch.randn(8))
    with pytest.raises(SsdIoError, match=r"act_l1_m0\.bin"):
        activations.clear()  # the step's end completes the write
    assert not store.pending


def test_clear_with_real_aio_transfers_in_flight(tmp_path):
    ssd = SsdStore(str(tmp_path), AioSettings(), IoCounters(), "act")
    activations = ActivationStore(ssd, 0, CPU, staging_buffers=2)
    activations.expect_reads([(1, 2), (1, 1), (1, 0)])
    for micro_batch in range(4):
        activations.put(1, micro_batch, torch.randn(64, 64))
    assert ssd.read_in_flight
    activations.clear()
    assert not ssd._in_flight
    ssd.close()


def test_a_failed_read_raises_naming_its_file(tmp_path):
    ssd = SsdStore(str(tmp_path), AioSettings(), IoCounters(), "act")
    activations = ActivationStore(ssd, 0, CPU, staging_buffers=1)
    for micro_batch in range(3):
        activations.put(1, micro_batch, torch.randn(32, 32))
    path = tmp_path / "act_act_l1_m0.bin"
    path.write_bytes(bytes(path.stat().st_size))  # what a lost write leaves: no tag
    with pytest.raises(SsdIoError, match=r"act_l1_m0\.bin"):
        activations.take(1, 0)
    activations.clear()
    ssd.close()


@pytest.mark.parametrize("same_step", [False, True])
def test_a_bigger_checkpoint_for_a_key_replaces_its_region_and_buffer(tmp_path, same_step):
    store, activations = lazy_activations(tmp_path, 2)
    small = {micro_batch: torch.randn(2, 4) for micro_batch in range(3)}
    big = {micro_batch: torch.randn(8, 4) for micro_batch in range(3)}
    for micro_batch, value in small.items():
        activations.put(1, micro_batch, value)
    for micro_batch in small:
        assert torch.equal(activations.take(1, micro_batch), small[micro_batch])
    if not same_step:
        activations.clear()
    # In the same step, the last one put is still in a buffer, its write in flight: its put waits for it first.
    for micro_batch, value in reversed(big.items()):
        activations.put(1, micro_batch, value)
    for micro_batch, value in big.items():
        assert torch.equal(activations.take(1, micro_batch), value)
    activations.clear()
    assert ("buffer", padded_size(8 * 4 * 4)) in store.log


# ----------------------------------------------------------------------------- host slots reused by capacity


def test_host_slots_are_reused_by_capacity(monkeypatch):
    """Checkpoints and input gradients in host slots: a smaller batch (an evaluation, a short last batch), then the
    bigger one again, register no host memory after the first big one."""
    registrations = []
    register = transfers_module.register_host_memory
    monkeypatch.setattr(transfers_module, "register_host_memory",
                        lambda address, num_bytes: registrations.append(num_bytes) or register(address, num_bytes))
    streams = PendingStreams()
    copies = Transfers(CPU, streams)
    activations = ActivationStore(None, 1 << 30, CPU, transfers=copies)
    gradients = InputGradients(CPU, copies)
    counts = []
    for rows in (8, 2, 8, 5):
        values = {micro_batch: torch.randn(rows, 16) for micro_batch in range(3)}
        for micro_batch, value in values.items():
            activations.put(1, micro_batch, value)
            gradients.put(micro_batch, value * 2)
        for micro_batch, value in values.items():
            assert torch.equal(activations.take(1, micro_batch), value)
        for micro_batch in reversed(range(3)):
            assert torch.equal(gradients.take(micro_batch), values[micro_batch] * 2)
        activations.clear()
        gradients.clear()
        counts.append(len(registrations))
    # Three checkpoint slots and two parked gradients (the latest stays on the device) for the first big batch.
    assert counts == [5, 5, 5, 5], counts
