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
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from .. import deepspeed_compat
from . import transfers
from .io_trace import IoRecorder
from .ssd_layout import ALIGNMENT, TAG_BYTES as _TAG_BYTES, padded_size, round_up  # noqa: F401 (re-exported)

# Transfers are split into chunks issued together (see SsdStore).
CHUNK_BYTES = 4 << 20
MAX_CHUNKS = 16


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


def aligned_buffer(num_bytes: int) -> torch.Tensor:
    """A uint8 host tensor whose first byte is 4096-byte aligned (pinned, at its exact size, where the
    accelerator pins: ``transfers.host_buffer``)."""
    return transfers.host_buffer(num_bytes, ALIGNMENT)


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
    """Regions in one folder, with two aio handles; not thread-safe (one owner per store).

    Reads and writes are asynchronous and may be in flight together: ``wait`` completes all of them
    (an aio handle can only wait for everything it has in flight). Each transfer is split into
    chunks issued at once, since one aio op keeps too few requests in flight to reach the SSD's rate
    (measured here: a 128 MiB read at 819 MiB/s as one op, 1345 MiB/s as 16; writes 1111 vs 2121).
    Reads and writes go to separate handles: a handle's thread runs its ops one after another, so on
    one handle a write and a read issued together would take turns instead of sharing the SSD
    (measured here: a 50 MiB write with a 38 MiB read, 34 ms on one handle, 32 ms on two).
    """

    def __init__(self, folder: str, aio: deepspeed_compat.AioSettings, counters: IoCounters, name: str,
                 read_handles: int = 1,
                 recorder: Optional[IoRecorder] = None):
        self.folder = folder
        # Records every transfer and wait while a trace is on (io_trace.py): the replay's input.
        self.recorder = recorder if recorder is not None else IoRecorder("unrecorded")
        self.aio = aio  # what its aio handles are made with (the optimizer worker's store takes the same)
        self.counters = counters
        self.name = name
        if read_handles < 1:
            raise ValueError(f"an SsdStore needs at least one read handle, got {read_handles}")
        # With several read handles, each read in flight has a handle of its own, so that one read can
        # be waited for (``wait_for_read``) while the others stay in flight: a handle only waits for all.
        self._read_handles = [deepspeed_compat.new_aio_handle(aio) for _ in range(read_handles)]
        self._write_handle = deepspeed_compat.new_aio_handle(aio)
        # Locked buffers belong to the handle that allocated them (and are freed through it); any
        # handle transfers them.
        self._buffer_handle = self._read_handles[0]
        self._locked_buffers: List[torch.Tensor] = []  # unlocked by close (DeepSpeed's handle only munlocks)
        self._closed = False
        self._in_flight: List[_Transfer] = []
        self._next_id = 0
        os.makedirs(folder, exist_ok=True)

    def create_region(self, label: str, payload_bytes: int, category: str, file_bytes: int = 0) -> Region:
        """A new file of ``max(file_bytes, padded size)`` bytes, preallocated, holding one region at its start
        (``alias_region`` adds others over the same file)."""
        self._next_id += 1
        path = os.path.join(self.folder, f"{self.name}_{label}.bin")
        region = Region(self._next_id, path, payload_bytes, category)
        descriptor = os.open(region.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, max(file_bytes, region.padded_bytes))
        except OSError as error:
            if error.errno == errno.ENOSPC:
                raise SsdIoError(error.errno, f"no space left to allocate {region.padded_bytes} bytes for "
                                 f"{region.path}: free space on the SSD or choose another nvme_path") from None
            raise SsdIoError(error.errno, f"cannot allocate {region.path}: {error.strerror}") from None
        finally:
            os.close(descriptor)
        return region

    def alias_region(self, region: Region, payload_bytes: int, category: str) -> Region:
        """A second region at the start of ``region``'s file (one of this store's: region ids, so tags, are
        unique within a store), with a tag of its own: reading one after the other was written fails the tag
        check, as a read of stale data must. The file must be long enough (``create_region``'s ``file_bytes``)."""
        self._next_id += 1
        alias = Region(self._next_id, region.path, payload_bytes, category)
        assert os.path.getsize(region.path) >= alias.padded_bytes, (region.path, alias.padded_bytes)
        return alias

    def buffer(self, num_bytes: int) -> torch.Tensor:
        """An aligned host buffer this store transfers without a bounce copy; lives as long as the store."""
        self._check_open()
        locked = deepspeed_compat.new_locked_buffer(self._buffer_handle, num_bytes)
        if locked is None:
            return aligned_buffer(num_bytes)
        self._locked_buffers.append(locked)
        return locked

    def free_buffer(self, buffer: torch.Tensor) -> None:
        """Give back a buffer from ``buffer`` that is no longer used (locked memory is not freed by torch)."""
        self._check_open()
        deepspeed_compat.free_locked_buffer(self._buffer_handle, buffer)
        self._locked_buffers = [kept for kept in self._locked_buffers if kept is not buffer]

    def close(self) -> None:
        """Complete what is in flight (an aio handle destroyed with ops pending aborts the process), unlock
        this store's buffers and drop its aio handles: their threads and kernel aio contexts end with them.
        The store transfers nothing afterwards. Called by the engine's close and by a failed initialize."""
        if self._closed:
            return
        try:
            if self._in_flight:
                self._wait_handles(self._in_flight)
        finally:
            self._in_flight = []
            for buffer in self._locked_buffers:
                deepspeed_compat.free_locked_buffer(self._buffer_handle, buffer)
            self._locked_buffers = []
            self._read_handles, self._write_handle, self._buffer_handle = [], None, None
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {self.name} SSD store under {self.folder} is closed (engine.close() was called)")

    def new_buffer(self, region: Region) -> torch.Tensor:
        return self.buffer(region.padded_bytes)

    def start_write(self, region: Region, buffer: torch.Tensor) -> None:
        """Begin writing ``buffer`` (stamped with the region's next tag) to ``region``; ``wait`` completes it.
        The buffer must not change until then."""
        self._check_buffer(region, buffer)
        region.generation += 1
        _tag_view(buffer[:region.padded_bytes]).fill_(region.expected_tag())
        self._submit(_Transfer("write", region, buffer))

    def start_read(self, region: Region, buffer: torch.Tensor) -> None:
        """Begin reading ``region`` into ``buffer``; ``wait`` completes and checks it."""
        self.start_read_regions([region], buffer)

    def start_read_regions(self, regions: Sequence[Region], buffer: torch.Tensor) -> None:
        """Begin reading ``regions`` into consecutive parts of one buffer (each at the sum of the padded sizes
        before it: ``buffer_offsets``), on one read handle, as one read: ``wait_for_read(buffer)`` completes
        and checks them all (a layer's trainable weights and its frozen ones)."""
        self._check_open()
        handle = self._free_read_handle()
        for region, offset in zip(regions, buffer_offsets(regions)):
            part = buffer[offset:]
            self._check_buffer(region, part)
            _tag_view(part[:region.padded_bytes]).zero_()
            self._submit(_Transfer("read", region, buffer, offset=offset), handle)

    def wait(self) -> None:
        """Complete every transfer in flight: check the op count and each read's tag, count the bytes."""
        if not self._in_flight:
            return
        transfers, self._in_flight = self._in_flight, []
        self._check_completed(transfers, self._wait_handles(transfers))

    def wait_reads(self) -> None:
        """Complete (and check) every read in flight, leaving the writes in flight: reads and writes go to
        different handles."""
        self._wait_kind("read")

    def wait_writes(self) -> None:
        """Complete every write in flight, leaving the reads in flight."""
        self._wait_kind("write")

    def _wait_kind(self, kind: str) -> None:
        mine = [t for t in self._in_flight if t.kind == kind]
        if not mine:
            return
        self._in_flight = [t for t in self._in_flight if t.kind != kind]
        self._check_completed(mine, self._wait_handles(mine))

    def wait_for_read(self, buffer: torch.Tensor) -> None:
        """Complete the read in flight into ``buffer`` (checked and counted as by ``wait``), leaving the
        other transfers in flight; with one read handle (its reads share it), this is ``wait``."""
        mine = [t for t in self._in_flight if t.kind == "read" and t.buffer is buffer]
        if not mine:
            return  # completed by an earlier wait
        if len(self._read_handles) == 1:
            self.wait()
            return
        # One read (of one region or several) is on one handle, alone there (``_free_read_handle``).
        assert len({id(t.handle) for t in mine}) == 1, "the parts of one read went to different handles"
        self._in_flight = [t for t in self._in_flight if all(t is not other for other in mine)]
        completed = self._wait_on([mine[0].handle]) if any(t.num_ops for t in mine) else 0
        self._check_completed(mine, completed)

    def _check_completed(self, transfers: List["_Transfer"], completed: int) -> None:
        expected_ops = sum(transfer.num_ops for transfer in transfers)
        if completed != expected_ops:
            for transfer in transfers:
                if transfer.kind == "write":
                    transfer.region.generation -= 1  # what is on SSD is unknown; its reads fail the tag check
            paths = ", ".join(f"{t.kind} {t.region.path}" for t in transfers)
            raise SsdIoError(errno.EIO, f"aio completed {completed} of {expected_ops} ops ({paths}): "
                             "check the SSD path (free space, permissions, device errors in dmesg)")
        for transfer in transfers:
            region = transfer.region
            if transfer.kind == "read":
                found = int(_tag_view(transfer.target()).item())
                if found != region.expected_tag():
                    raise SsdIoError(errno.EIO, f"aio read of {region.padded_bytes} bytes from {region.path} found "
                                     f"tag {found:#x}, expected {region.expected_tag():#x}: the data on SSD is not "
                                     "what was last written (failed write or read)")
                self.counters.bytes_read[region.category] += region.padded_bytes
                self.counters.reads[region.category] += 1
            else:
                self.counters.bytes_written[region.category] += region.padded_bytes
                self.counters.writes[region.category] += 1

    def write(self, region: Region, buffer: torch.Tensor) -> None:
        self.start_write(region, buffer)
        self.wait()

    def read(self, region: Region, buffer: torch.Tensor) -> None:
        self.start_read(region, buffer)
        self.wait()

    @property
    def read_in_flight(self) -> bool:
        return any(transfer.kind == "read" for transfer in self._in_flight)

    def in_flight(self, buffer: torch.Tensor, kind: str) -> bool:
        """Whether a ``kind`` ("read" or "write") transfer into or from ``buffer`` is in flight (not yet waited for)."""
        return any(transfer.kind == kind and transfer.buffer is buffer for transfer in self._in_flight)

    def _wait_handles(self, transfers: List["_Transfer"]) -> int:
        """Wait on every handle with ops of ``transfers`` in flight; the number of ops they completed."""
        handles = list({id(t.handle): t.handle for t in transfers if t.num_ops}.values())
        return self._wait_on(handles)

    def _wait_on(self, handles) -> int:
        started = time.monotonic()
        completed = sum(handle.wait() for handle in handles)
        if self.recorder.enabled:
            self.recorder.wait(self.name, [self._handle_label(handle) for handle in handles], started)
        return completed

    def _handle_label(self, handle) -> str:
        """"r<i>" for the i-th read handle, "w" for the write handle (the names a trace gives them)."""
        if handle is self._write_handle:
            return "w"
        return f"r{next(i for i, h in enumerate(self._read_handles) if h is handle)}"

    def _free_read_handle(self):
        """A read handle with nothing in flight; with one handle, that handle (its ops queue). When every
        handle is busy (a read beyond the prefetch depth: a tied layer's lender), everything in flight
        is completed first: correct, only less overlapped."""
        if len(self._read_handles) == 1:
            return self._read_handles[0]
        busy = [t.handle for t in self._in_flight if t.kind == "read"]
        free = [h for h in self._read_handles if not any(h is other for other in busy)]
        if not free:
            self.wait()
            return self._read_handles[0]
        return free[0]

    def _submit(self, transfer: "_Transfer", handle=None) -> None:
        self._check_open()
        if handle is None:
            handle = self._free_read_handle() if transfer.kind == "read" else self._write_handle
        transfer.handle = handle
        region, issue = transfer.region, (handle.pread if transfer.kind == "read" else handle.pwrite)
        target = transfer.target()
        for offset, length in chunks(region.padded_bytes):
            result = issue(target[offset:offset + length], region.path, False, True, offset)
            if result < 0:
                # Complete whatever is in flight (a handle destroyed with pending ops aborts the
                # process); none of it is trusted after a failed submission.
                self._wait_handles(self._in_flight + [transfer])
                for abandoned in self._in_flight + [transfer]:
                    if abandoned.kind == "write":
                        abandoned.region.generation -= 1
                self._in_flight.clear()
                raise SsdIoError(errno.EIO, f"aio {transfer.kind} of {length} bytes at offset {offset} of "
                                 f"{region.path} could not start (return code {result})")
            transfer.num_ops += 1
        self._in_flight.append(transfer)
        if self.recorder.enabled:
            self.recorder.issue(self.name, self._handle_label(handle), transfer.kind, region.path,
                                region.padded_bytes, region.category)

    def _check_buffer(self, region: Region, buffer: torch.Tensor) -> None:
        assert buffer.dtype == torch.uint8 and buffer.data_ptr() % ALIGNMENT == 0
        assert buffer.numel() >= region.padded_bytes, (buffer.numel(), region.padded_bytes)


@dataclass
class _Transfer:
    kind: str  # "read" or "write"
    region: Region
    buffer: torch.Tensor  # the whole buffer (what wait_for_read names)
    num_ops: int = 0
    handle: object = None  # the aio handle its ops went to
    offset: int = 0  # where in ``buffer`` the region's bytes go

    def target(self) -> torch.Tensor:
        return self.buffer[self.offset:self.offset + self.region.padded_bytes]


def buffer_offsets(regions: Sequence[Region]) -> List[int]:
    """Where each of ``regions`` starts in a buffer holding them one after another (``start_read_regions``)."""
    offsets, total = [], 0
    for region in regions:
        offsets.append(total)
        total += region.padded_bytes
    return offsets


def chunks(num_bytes: int):
    """(offset, length) pieces of a transfer: about CHUNK_BYTES each, at most MAX_CHUNKS, 4096-aligned."""
    count = max(1, min(MAX_CHUNKS, num_bytes // CHUNK_BYTES))
    length = round_up(-(-num_bytes // count))
    return [(offset, min(length, num_bytes - offset)) for offset in range(0, num_bytes, length)]
