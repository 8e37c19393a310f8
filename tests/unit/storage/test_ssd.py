"""SSD regions through DeepSpeed's aio handle: round trips, and reads that must not pass silently."""
import os

import pytest
import torch

from ds_greedysnake.deepspeed_compat import AioSettings
from ds_greedysnake.storage import ssd
from ds_greedysnake.storage.ssd import ALIGNMENT, IoCounters, SsdIoError, SsdStore, aligned_buffer


@pytest.fixture
def store(tmp_path):
    return SsdStore(str(tmp_path), AioSettings(), IoCounters(), "test")


def test_aligned_buffer():
    for size in (1, 4096, 12345):
        assert aligned_buffer(size).data_ptr() % ALIGNMENT == 0


def test_round_trip_counts_bytes(store):
    region = store.create_region("a", 10_000, "param")
    assert os.path.getsize(region.path) == region.padded_bytes == 12_288
    source = store.new_buffer(region)
    source[:10_000].view(torch.float32).copy_(torch.arange(2_500, dtype=torch.float32))
    store.write(region, source)
    target = store.new_buffer(region)
    store.read(region, target)
    assert torch.equal(target[:10_000], source[:10_000])
    assert store.counters.bytes_read["param"] == store.counters.bytes_written["param"] == 12_288
    assert store.counters.reads["param"] == 1


def test_transfers_in_flight_together(store):
    """Reads and writes of several regions in flight at once; one wait completes and checks them all."""
    first, second = store.create_region("a", 8_192, "param"), store.create_region("b", 8_192, "grad")
    source = store.new_buffer(first)
    source.fill_(3)
    store.write(first, source)
    other = store.new_buffer(second)
    other.fill_(5)
    target = store.new_buffer(first)
    store.start_read(first, target)
    store.start_write(second, other)
    assert store.read_in_flight
    store.wait()
    assert not store.read_in_flight
    assert int(target[:8_192 - 8].sum()) == 3 * (8_192 - 8)
    assert store.counters.reads["param"] == 1 and store.counters.writes["grad"] == 1
    store.wait()  # nothing in flight: a no-op


def _written_regions(store, count, num_bytes):
    regions, buffers = [], []
    for index in range(count):
        region = store.create_region(f"r{index}", num_bytes, "param")
        source = store.new_buffer(region)
        source.fill_(index + 1)
        store.write(region, source)
        regions.append(region)
        buffers.append(store.new_buffer(region))
    return regions, buffers


def test_one_read_waited_while_others_stay_in_flight(tmp_path):
    """With a read handle per read, waiting for one read completes it alone, checked and counted."""
    store = SsdStore(str(tmp_path), AioSettings(), IoCounters(), "deep", read_handles=2)
    num_bytes = 3 * ssd.CHUNK_BYTES  # three ops per read
    (first, second), (first_buffer, second_buffer) = _written_regions(store, 2, num_bytes)
    store.start_read(first, first_buffer)
    store.start_read(second, second_buffer)
    store.wait_for_read(first_buffer)
    assert store.read_in_flight and store.counters.reads["param"] == 1
    assert int(first_buffer[:num_bytes].float().mean()) == 1
    store.wait_for_read(second_buffer)
    assert not store.read_in_flight and store.counters.reads["param"] == 2
    assert int(second_buffer[:num_bytes].float().mean()) == 2
    store.wait_for_read(second_buffer)  # already complete: a no-op


def test_waiting_for_one_read_still_checks_its_tag(tmp_path):
    store = SsdStore(str(tmp_path), AioSettings(), IoCounters(), "deep", read_handles=2)
    (first, second), (first_buffer, second_buffer) = _written_regions(store, 2, 8_192)
    first.generation += 1  # as if a later write of it had been lost
    store.start_read(first, first_buffer)
    store.start_read(second, second_buffer)
    with pytest.raises(SsdIoError, match="found tag"):
        store.wait_for_read(first_buffer)
    store.wait_for_read(second_buffer)
    assert store.counters.reads["param"] == 1


def test_a_read_beyond_the_handles_completes_the_others_first(tmp_path):
    store = SsdStore(str(tmp_path), AioSettings(), IoCounters(), "deep", read_handles=2)
    regions, buffers = _written_regions(store, 3, 8_192)
    for region, buffer in zip(regions, buffers):
        store.start_read(region, buffer)
    assert store.counters.reads["param"] == 2  # the first two were completed to free a handle
    store.wait_for_read(buffers[2])
    assert [int(buffer[:8_000].float().mean()) for buffer in buffers] == [1, 2, 3]


def test_large_region_goes_in_chunks_and_round_trips(store):
    num_bytes = 3 * ssd.CHUNK_BYTES + 12_345
    pieces = ssd.chunks(ssd.padded_size(num_bytes))
    assert len(pieces) == 3 and all(offset % ssd.ALIGNMENT == 0 for offset, _ in pieces)
    assert sum(length for _, length in pieces) == ssd.padded_size(num_bytes)
    assert len(ssd.chunks(ssd.MAX_CHUNKS * 10 * ssd.CHUNK_BYTES)) == ssd.MAX_CHUNKS
    region = store.create_region("big", num_bytes, "optimizer")
    source = store.new_buffer(region)
    source[:num_bytes].copy_(torch.randint(0, 256, (num_bytes,), dtype=torch.uint8))
    store.write(region, source)
    target = store.new_buffer(region)
    store.read(region, target)
    assert torch.equal(target[:num_bytes], source[:num_bytes])


def test_stale_data_is_detected(store):
    """A write that never reached the file (here: the file rewritten behind our back) fails the next read."""
    region = store.create_region("a", 4_000, "optimizer")
    buffer = store.new_buffer(region)
    store.write(region, buffer)
    store.write(region, buffer)  # generation 2 is what the next read must find
    with open(region.path, "r+b") as handle:
        handle.seek(region.padded_bytes - 8)
        handle.write((region.expected_tag() - 1).to_bytes(8, "little"))  # generation 1's tag
    with pytest.raises(SsdIoError, match=f"from {region.path}.*not what was last written"):
        store.read(region, store.new_buffer(region))


def test_unfilled_region_is_detected(store):
    region = store.create_region("never_written", 4_000, "param")
    region.generation = 1  # pretend a write happened: the file holds zeros, not its tag
    with pytest.raises(SsdIoError, match="tag 0x0, expected 0x100000001"):
        store.read(region, store.new_buffer(region))


def test_full_disk_at_allocation_names_file_and_bytes(store):
    with pytest.raises(SsdIoError, match=r"(no space left to allocate|cannot allocate) .*huge"):
        store.create_region("huge", 1 << 62, "param")


def test_one_run_owns_a_swap_folder(tmp_path):
    from ds_greedysnake.storage.ssd import SwapFolderInUse, SwapFolderLock

    (tmp_path / "stale.bin").write_bytes(b"left by a dead run")
    first = SwapFolderLock(str(tmp_path))
    assert not (tmp_path / "stale.bin").exists()
    with pytest.raises(SwapFolderInUse, match=f"in use by another greedysnake run \\(pid {os.getpid()}\\)"):
        SwapFolderLock(str(tmp_path))
    first.release()
    SwapFolderLock(str(tmp_path)).release()  # a dead or finished run's folder is taken over


def test_a_killed_owner_frees_the_folder(tmp_path):
    import subprocess
    import sys
    from ds_greedysnake.storage.ssd import SwapFolderLock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from ds_greedysnake.storage.ssd import SwapFolderLock; lock = SwapFolderLock(sys.argv[2]); "
                               "print('locked', flush=True); time.sleep(60)",
                               os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                               str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()
    holder.wait()
    SwapFolderLock(str(tmp_path)).release()


def test_a_transfer_that_cannot_start_names_the_file_and_leaves_nothing_in_flight(store):
    kept = store.create_region("kept", 8_192, "param")
    buffer = store.new_buffer(kept)
    store.write(kept, buffer)
    store.start_read(kept, store.new_buffer(kept))  # in flight when the next submission fails
    gone = store.create_region("gone", 8_192, "param")
    os.remove(gone.path)
    with pytest.raises(SsdIoError, match=f"aio read of .* of {gone.path} could not start"):
        store.start_read(gone, store.new_buffer(gone))
    assert not store.read_in_flight
    store.read(kept, buffer)  # the store still works


@pytest.mark.parametrize("read_handles", [1, 2])
def test_several_regions_read_into_one_buffer_as_one_read(tmp_path, read_handles):
    """A layer's trainable slot and its frozen region: one read into consecutive parts of one buffer, on one
    handle, completed together by one wait_for_read, each part's tag checked; other reads stay in flight."""
    store = SsdStore(str(tmp_path), AioSettings(), IoCounters(), "multi", read_handles=read_handles)
    (first, second, other), (_, _, other_buffer) = _written_regions(store, 3, 2 * ssd.CHUNK_BYTES + 100)
    assert ssd.buffer_offsets([first, second]) == [0, first.padded_bytes]
    both = store.buffer(first.padded_bytes + second.padded_bytes)
    store.start_read_regions([first, second], both)
    store.start_read(other, other_buffer)
    store.wait_for_read(both)
    assert store.counters.reads["param"] == (2 if read_handles > 1 else 3)
    assert int(both[:first.payload_bytes].float().mean()) == 1
    assert int(both[first.padded_bytes:first.padded_bytes + second.payload_bytes].float().mean()) == 2
    store.wait_for_read(other_buffer)
    assert int(other_buffer[:other.payload_bytes].float().mean()) == 3
    second.generation += 1  # as if a later write of the second region had been lost
    store.start_read_regions([first, second], both)
    with pytest.raises(SsdIoError, match="found tag"):
        store.wait_for_read(both)
