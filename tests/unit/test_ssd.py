"""SSD regions through DeepSpeed's aio handle: round trips, and reads that must not pass silently."""
import os

import pytest
import torch

from ds_greedysnake.ssd import ALIGNMENT, IoCounters, SsdIoError, SsdStore, aligned_buffer


@pytest.fixture
def store(tmp_path):
    return SsdStore(str(tmp_path), {}, IoCounters(), "test")


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


def test_asynchronous_read(store):
    region = store.create_region("a", 8_192, "param")
    source = store.new_buffer(region)
    source.fill_(3)
    store.write(region, source)
    target = store.new_buffer(region)
    store.start_read(region, target)
    assert store.read_in_flight
    with pytest.raises(RuntimeError, match="still in flight"):
        store.start_read(region, store.new_buffer(region))
    store.finish_read()
    assert int(target[:8_192].sum()) == 3 * 8_192


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
