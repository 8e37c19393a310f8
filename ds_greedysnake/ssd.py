"""SSD-resident regions read and written through DeepSpeed's async I/O handle, checked.

Every region is one file, preallocated at creation (so a full disk fails at start-up, not mid-step),
read and written whole, from 4096-byte aligned buffers, padded to a multiple of 4096 bytes. The
last 8 bytes of each region hold a tag (region id and write generation). A read clears the tag in
the buffer first and checks it afterwards: DeepSpeed's aio completion codes are not checked by the
op itself, and a read that silently did nothing (misaligned pinned memory, a failed write before it)
would otherwise hand back stale bytes.
"""
import errno
import fcntl
import glob
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict

import torch

from . import deepspeed_compat

ALIGNMENT = 4096
_TAG_BYTES = 8


class SsdIoError(OSError):
    """An SSD read or write failed; the message names the file, the bytes and the return code."""


class SwapFolderInUse(RuntimeError):
    """Another live run owns the swap folder."""


class SwapFolderLock:
    """One run owns a swap folder: an exclusive lock on ``<folder>/.lock``, held while the run lives.

    The kernel drops the lock when its holder dies, so a dead run's folder is taken over: its stale
    region files are removed, and every region is created afresh.
    """

    def __init__(self, folder: str):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, ".lock")
        self._descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._descriptor, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._descriptor)
            self._descriptor = None
            raise SwapFolderInUse(
                f"swap folder {folder} is in use by another greedysnake run (pid {holder}): give each run its own "
                "nvme_path (or greedysnake.swap_dir_name), or stop the other run") from None
        os.ftruncate(self._descriptor, 0)
        os.pwrite(self._descriptor, f"{os.getpid()}\n".encode(), 0)
        for stale in glob.glob(os.path.join(folder, "*.bin")):
            os.remove(stale)

    def release(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)  # closing the descriptor drops the lock
            self._descriptor = None

    def __del__(self):
        self.release()


def round_up(num_bytes: int, multiple: int = ALIGNMENT) -> int:
    return (num_bytes + multiple - 1) // multiple * multiple


def padded_size(payload_bytes: int) -> int:
    """Bytes a region of ``payload_bytes`` occupies on SSD and in its buffer (payload, padding, tag)."""
    return round_up(payload_bytes + _TAG_BYTES)


def aligned_buffer(num_bytes: int) -> torch.Tensor:
    """A uint8 host tensor whose first byte is 4096-byte aligned (pinned where the accelerator pins)."""
    base = deepspeed_compat.pin_if_possible(torch.empty(num_bytes + ALIGNMENT, dtype=torch.uint8))
    offset = (-base.data_ptr()) % ALIGNMENT
    buffer = base[offset:offset + num_bytes]
    assert buffer.data_ptr() % ALIGNMENT == 0
    return buffer


@dataclass
class IoCounters:
    """Bytes and operations per category ("param", "optimizer", "grad", "activation")."""
    bytes_read: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_written: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    reads: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    writes: Dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        return {name: dict(getattr(self, name)) for name in ("bytes_read", "bytes_written", "reads", "writes")}


@dataclass
class Region:
    """One file holding ``payload_bytes`` of data plus padding and the tag."""
    region_id: int
    path: str
    payload_bytes: int
    category: str
    generation: int = 0

    @property
    def padded_bytes(self) -> int:
        return padded_size(self.payload_bytes)

    def expected_tag(self) -> int:
        return (self.region_id << 32) | (self.generation & 0xFFFFFFFF)


def _tag_view(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[buffer.numel() - _TAG_BYTES:].view(torch.int64)


class SsdStore:
    """Regions in one folder, with one aio handle; not thread-safe (one owner per store)."""

    def __init__(self, folder: str, ds_config: dict, counters: IoCounters, name: str):
        self.folder = folder
        self.ds_config = ds_config
        self.counters = counters
        self.name = name
        self._handle = deepspeed_compat.new_aio_handle(ds_config)
        self._pending = None  # (region, buffer) of the one asynchronous read in flight
        self._next_id = 0
        os.makedirs(folder, exist_ok=True)

    def create_region(self, label: str, payload_bytes: int, category: str) -> Region:
        self._next_id += 1
        region = Region(self._next_id, os.path.join(self.folder, f"{self.name}_{label}.bin"), payload_bytes, category)
        descriptor = os.open(region.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, region.padded_bytes)
        except OSError as error:
            if error.errno == errno.ENOSPC:
                raise SsdIoError(error.errno, f"no space left to allocate {region.padded_bytes} bytes for "
                                 f"{region.path}: free space on the SSD or choose another nvme_path") from None
            raise SsdIoError(error.errno, f"cannot allocate {region.path}: {error.strerror}") from None
        finally:
            os.close(descriptor)
        return region

    def new_buffer(self, region: Region) -> torch.Tensor:
        return aligned_buffer(region.padded_bytes)

    def write(self, region: Region, buffer: torch.Tensor) -> None:
        self._check_buffer(region, buffer)
        region.generation += 1
        _tag_view(buffer[:region.padded_bytes]).fill_(region.expected_tag())
        result = self._handle.pwrite(buffer[:region.padded_bytes], region.path, False, False, 0)
        if result < 0:
            region.generation -= 1
            raise SsdIoError(errno.EIO, f"aio write of {region.padded_bytes} bytes to {region.path} failed "
                             f"(return code {result})")
        self.counters.bytes_written[region.category] += region.padded_bytes
        self.counters.writes[region.category] += 1

    def start_read(self, region: Region, buffer: torch.Tensor) -> None:
        """Begin reading ``region`` into ``buffer``; ``finish_read`` waits and checks it."""
        if self._pending is not None:
            raise RuntimeError(f"store {self.name}: a read of {self._pending[0].path} is still in flight")
        self._check_buffer(region, buffer)
        _tag_view(buffer[:region.padded_bytes]).zero_()
        result = self._handle.pread(buffer[:region.padded_bytes], region.path, False, True, 0)
        if result < 0:
            raise SsdIoError(errno.EIO, f"aio read of {region.padded_bytes} bytes from {region.path} could not "
                             f"start (return code {result})")
        self._pending = (region, buffer)

    def finish_read(self) -> None:
        region, buffer = self._pending
        self._pending = None
        completed = self._handle.wait()
        found = int(_tag_view(buffer[:region.padded_bytes]).item())
        if completed < 1 or found != region.expected_tag():
            raise SsdIoError(errno.EIO, f"aio read of {region.padded_bytes} bytes from {region.path} returned "
                             f"{completed} completed ops and tag {found:#x}, expected {region.expected_tag():#x}: "
                             "the data on SSD is not what was last written (failed write or read)")
        self.counters.bytes_read[region.category] += region.padded_bytes
        self.counters.reads[region.category] += 1

    def read(self, region: Region, buffer: torch.Tensor) -> None:
        self.start_read(region, buffer)
        self.finish_read()

    @property
    def read_in_flight(self) -> bool:
        return self._pending is not None

    def _check_buffer(self, region: Region, buffer: torch.Tensor) -> None:
        assert buffer.dtype == torch.uint8 and buffer.data_ptr() % ALIGNMENT == 0
        assert buffer.numel() >= region.padded_bytes, (buffer.numel(), region.padded_bytes)
