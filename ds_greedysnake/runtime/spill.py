"""Spilled layer-input checkpoints: a small ring of staging buffers between the device and the SSD.

A spilled checkpoint leaves the device by a copy on the outbound transfer stream into a staging buffer.
Its aio write starts once that copy is seen done (``poll``, which the executor calls after every op: an
event query, no wait) or when the buffer is needed, and completes lazily: when the buffer is needed
again, or at the end of the step (``clear``). A checkpoint comes back from the SSD by a read started
ahead of time, in the order the executor reads checkpoints (``schedule.checkpoint_reads``, handed over at
the step's start), into a free staging buffer; or, while its bytes are still in a staging buffer (spilled
or read a short while ago), from that buffer without touching the SSD: the same bytes the write takes.

Which buffer is taken: one that needs no wait on the device if there is one, then the one whose
checkpoint is read again furthest in the future, or never (the read order is known: Belady's choice),
then one with no aio transfer in flight. A prefetch takes no buffer whose checkpoint is read before the
one it brings, and none that would make the host wait on the device.

Invariants:
* a buffer is reused only once the copies and the aio transfer using it completed: the aio write or read
  of it is waited for on the host; the device copy into it, before an aio read lands in it or it is
  freed (on the host), before a copy into it (on the device, by ``Transfers``);
* every aio transfer of a region in flight is that of the buffer holding its checkpoint, and a buffer
  gives its checkpoint up only once its transfers completed: so a region is never read from the SSD
  while its write is in flight (its bytes are read from the buffer then), and a spill of a key first
  empties the buffer holding it (``release``), so no region is rewritten or replaced while its write or
  read is in flight; ``clear`` leaves no aio transfer in flight (regions are kept across steps).

``STAGING_BUFFERS`` = 4. In forward with every checkpoint spilled each op reads one checkpoint and spills
one, so at once one buffer holds the checkpoint being read (its device copy in flight), one the next read
(prefetched) and one receives the spill (its copy, then its write): three is the fewest with which the
lagging device of tests/e2e/test_host_waits.py (4 events behind the host) never makes the host wait for a
buffer (two: 35 and 63 waits per step at M = 8, L = 4 and 8). The fourth is a margin for a device further
behind, whose spill copies complete later: with the double 8 events behind, M = 8, L = 4 and 8, three
buffers give 31 and 55 waits per step, four 9 and 13, six 6 and 6 (at M = 1: 8 and 16 whatever the
number: not the ring's). Each buffer is one checkpoint's bytes of host memory beside
``activation_host_memory_mb``, allocated when first needed (a step that spills little allocates fewer).
"""
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..storage.ssd import Region, SsdStore
from ..storage.transfers import COMPLETE, Guard, Transfers

Key = Tuple[int, int]  # (layer, micro_batch)

STAGING_BUFFERS = 4  # why four: the module docstring
READS_AHEAD = 2  # spilled checkpoints whose reads are kept started ahead of the one read now
_SCAN_READS = 8  # how far down the read order a poll looks for them
_NEVER = 1 << 62  # the next read of a checkpoint read no more


@dataclass
class Spilled:
    region: Region
    shape: torch.Size
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return self.shape.numel() * torch.empty(0, dtype=self.dtype).element_size()


class _Staging:
    """One staging buffer and what uses it."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None  # allocated when first needed
        self.key: Optional[Key] = None  # the checkpoint whose bytes it holds (or receives)
        self.copied_in: Guard = COMPLETE  # the copy from the device into it
        self.copied_out: Guard = COMPLETE  # the last copy from it to the device
        self.write: Optional[Region] = None  # where to write it once ``copied_in`` is done


class SpillRing:
    """The staging buffers of one activation store (see the module docstring); ``spilled`` holds what is on
    the SSD (or on its way there) by key."""

    def __init__(self, store: Optional[SsdStore], transfers: Transfers, buffers: int = STAGING_BUFFERS,
                 reads_ahead: int = READS_AHEAD):
        if buffers < 1:
            raise ValueError(f"the spill ring needs at least one staging buffer, got {buffers}")
        self._store, self._transfers = store, transfers
        self._staging = [_Staging() for _ in range(buffers)]
        self._holding: Dict[Key, _Staging] = {}
        self.spilled: Dict[Key, Spilled] = {}
        self._reads_ahead = reads_ahead
        self._order: List[Key] = []
        self._uses: Dict[Key, List[int]] = {}  # positions of each key in the read order
        self._cursor = 0  # the position of the next read

    # ------------------------------------------------------------------ the read order

    def expect_reads(self, order: Sequence[Key]) -> None:
        """The checkpoints the step (or evaluation) reads, in order; each ``note_read`` moves past one."""
        self._order, self._cursor = list(order), 0
        uses = defaultdict(list)
        for position, key in enumerate(self._order):
            uses[key].append(position)
        self._uses = dict(uses)

    def note_read(self, key: Key) -> None:
        """``key`` is read now (from whichever tier); a read off the announced order only moves the cursor."""
        position = self._next_use(key)
        if position != _NEVER:
            self._cursor = position + 1

    def _next_use(self, key: Optional[Key]) -> int:
        if key is None or key not in self.spilled:
            return _NEVER
        uses = self._uses.get(key, ())
        index = bisect_left(uses, self._cursor)
        return uses[index] if index < len(uses) else _NEVER

    # ------------------------------------------------------------------ spill and read

    def spill(self, key: Key, tensor: torch.Tensor, region: Region) -> None:
        """Copy ``tensor`` into a staging buffer on its way to ``region`` (``release(key)`` first)."""
        assert key not in self._holding, f"checkpoint {key} spilled while a buffer holds it: release it first"
        spilled = Spilled(region, tensor.shape, tensor.dtype)
        staging = self._take(region.padded_bytes, for_read=False)
        host = staging.buffer[:spilled.num_bytes].view(tensor.dtype)
        staging.copied_in = self._transfers.to_host(tensor.reshape(-1), host)
        staging.key, staging.write = key, region
        self._holding[key] = staging
        self.spilled[key] = spilled
        self.poll()

    def read(self, key: Key, keep: bool) -> torch.Tensor:
        """The checkpoint on the device: from the buffer holding it, else from the SSD. Without ``keep`` it is
        forgotten (its write, when not started yet, is not needed any more)."""
        spilled = self.spilled[key]
        staging = self._holding.get(key)
        if staging is None:
            staging = self._take(spilled.region.padded_bytes, for_read=True)
            self._start_read(staging, key, spilled.region)
        if self._store.in_flight(staging.buffer, "read"):
            self._store.wait_for_read(staging.buffer)
        host = staging.buffer[:spilled.num_bytes].view(spilled.dtype).view(spilled.shape)
        if self._transfers.device_is_host:
            on_device = host.clone()  # the buffer is reused
        else:
            on_device, staging.copied_out = self._transfers.to_device(host)
        if not keep:
            self.drop(key)
        self.poll()
        return on_device

    def drop(self, key: Key) -> None:
        """``key`` is not read again: its write, when not started, is not needed."""
        del self.spilled[key]
        staging = self._holding.get(key)
        if staging is not None:
            staging.write = None  # the buffer stays its holder until reused (``release`` finds it)

    def release(self, key: Key) -> None:
        """Before ``key`` is stored again: no transfer of its region left in flight (it may be rewritten)."""
        staging = self._holding.get(key)
        if staging is not None:
            self._empty(staging, for_read=False)
        self.spilled.pop(key, None)

    def poll(self) -> None:
        """Start the writes whose copy has run and the reads due next; waits for nothing."""
        for staging in self._staging:
            if staging.write is not None and staging.copied_in.done():
                self._start_write(staging)
        self._prefetch()

    def clear(self) -> None:
        """The step's end (or its abandonment): no aio transfer left in flight, every checkpoint forgotten
        (a write not started is not needed any more). Buffers, and the guards of their device copies, stay."""
        try:
            if self._store is not None:
                self._store.wait()
        finally:
            for staging in self._staging:
                staging.key, staging.write = None, None
            self._holding.clear()
            self.spilled.clear()
            self.expect_reads(())

    # ------------------------------------------------------------------ the buffers

    def _prefetch(self) -> None:
        """Start the reads of the next ``reads_ahead`` spilled checkpoints in the read order not in a buffer."""
        if not self.spilled:
            return
        considered = set()
        for position in range(self._cursor, min(len(self._order), self._cursor + _SCAN_READS)):
            key = self._order[position]
            if key in considered or key not in self.spilled:
                continue
            considered.add(key)
            if key not in self._holding:
                staging = self._take(self.spilled[key].region.padded_bytes, for_read=True, before=position)
                if staging is None:
                    return
                self._start_read(staging, key, self.spilled[key].region)
            if len(considered) >= self._reads_ahead:
                return

    def _take(self, num_bytes: int, for_read: bool, before: Optional[int] = None) -> Optional[_Staging]:
        """A buffer of at least ``num_bytes``, emptied for a copy into it (``for_read``: for an aio read into
        it). ``before``: for a prefetch of the read at that position, which must not wait on the device nor
        evict a checkpoint read earlier; None when no buffer qualifies."""
        best, best_rank = None, None
        for staging in self._staging:
            next_use = self._next_use(staging.key)
            device_wait = self._needs_device_wait(staging, for_read)
            if before is not None and (next_use <= before or device_wait):
                continue
            busy = any(self._store.in_flight(staging.buffer, kind) for kind in ("read", "write"))
            rank = (device_wait, -next_use, busy, staging.buffer is None)
            if best_rank is None or rank < best_rank:
                best, best_rank = staging, rank
        if best is None:
            return None
        self._empty(best, for_read)
        if best.buffer is None or best.buffer.numel() < num_bytes:
            self._grow(best, num_bytes)
        return best

    @staticmethod
    def _needs_device_wait(staging: _Staging, for_read: bool) -> bool:
        if staging.write is not None and not staging.copied_in.done():
            return True  # its write cannot start before its copy ran
        return for_read and not (staging.copied_in.done() and staging.copied_out.done())

    def _empty(self, staging: _Staging, for_read: bool) -> None:
        """Complete what uses ``staging`` (its write started first if still due) and let its checkpoint go."""
        if staging.write is not None:
            staging.copied_in.wait()
            self._start_write(staging)
        if self._store is not None and staging.buffer is not None:
            if self._store.in_flight(staging.buffer, "write"):
                self._store.wait_writes()
            if self._store.in_flight(staging.buffer, "read"):
                self._store.wait_for_read(staging.buffer)
        if for_read:
            staging.copied_in.wait()
            staging.copied_out.wait()
        if staging.key is not None:
            del self._holding[staging.key]
            staging.key = None

    def _grow(self, staging: _Staging, num_bytes: int) -> None:
        if staging.buffer is not None:
            staging.copied_in.wait()  # its memory goes now
            staging.copied_out.wait()
            self._store.free_buffer(staging.buffer)
        staging.buffer = None
        staging.buffer = self._store.buffer(num_bytes)
        staging.copied_in = staging.copied_out = COMPLETE

    def _start_write(self, staging: _Staging) -> None:
        region, staging.write = staging.write, None
        self._store.start_write(region, staging.buffer)

    def _start_read(self, staging: _Staging, key: Key, region: Region) -> None:
        self._store.start_read(region, staging.buffer)
        staging.key = key
        self._holding[key] = staging
