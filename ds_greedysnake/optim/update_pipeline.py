"""Runs queued Adam updates piece by piece, so that the SSD always has reads and writes in flight.

A layer's optimizer states on SSD are split into pieces of at most ``STATE_PIECE_NUMEL`` elements,
each its own region holding [fp32 master | exp_avg | exp_avg_sq] of that element range. One step of
the pipeline waits for the piece read last time, issues the read of the next piece (of this update or
of the next one queued), runs Adam on it while the writes issued last time are still in flight, then
waits for those writes and issues its own:

    wait read(i) -> read(i+1) issued -> Adam(i), write(i-1) in flight -> wait write(i-1) -> write(i) -> ...

Reading one layer while the previous one is written kept the SSD busy where the whole-layer
read / Adam / write sequence left it idle half the time; keeping the writes in flight over the next
Adam keeps it busy while Adam runs, which on a machine whose cores training also uses can take
longer than the read in flight. Three piece buffers (the one read, the one in Adam, the one written)
bound the locked memory by the piece size instead of 12 bytes times the largest layer, and two
weight buffers let one update's new weights be written while the next one's are cast.

Between the last update of one step and the first gradient of the next (the end of the next forward
and the start of its backward) nothing is queued and the SSD would idle: the training process hints
the pieces the next step's updates will read first (``ReadAheadPiece``, in their order), and the
pipeline reads them into its spare piece buffers meanwhile (``read_ahead``), so those updates start
with their states already in memory.

States kept in host memory (``host_memory.py``) are one piece, updated in place with no state I/O.
A layer with one state slot on SSD (``ssd_layout.py``) reads and writes the same pieces: a piece's
write is issued only after its read completed and Adam ran on it, a read ahead is only ever taken
while nothing is queued or in flight, and an update of a layer is only queued once the previous one
of that layer has completed (its next fetch waits for it), so no read of a piece overlaps its write.
A recast (``UpdateTask.recast_only``) only casts the committed master into the weights.
The new weights of a layer are cast into a layer-sized buffer piece by piece and written once its
last piece is done; a gradient that comes through SSD is read with the layer's first piece.
"""
import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch

from ..deepspeed_compat import CpuAdamKernel
from ..storage.host_memory import SharedHostMemory
from ..storage.ssd import Region, SsdStore, padded_size
from ..storage.ssd_layout import STATE_PIECE_NUMEL, piece_ranges  # noqa: F401 (re-exported)


@dataclass
class UpdateResult:
    task_id: int
    seconds: float
    bytes_read: int
    bytes_written: int
    error: Optional[str] = None
    bytes_read_ahead: int = 0  # of bytes_read: read ahead while the pipeline idled


@dataclass(frozen=True)
class ReadAheadPiece:
    """A piece of committed states the next update of ``layer`` reads (its ``index``-th): ``region`` is a
    copy carrying the generation that update will expect."""
    layer: int
    index: int
    region: Region


@dataclass
class _Piece:
    task: "UpdateTask"  # noqa: F821 (updates.UpdateTask, which imports this module)
    index: int
    start: int
    stop: int
    buffer: Optional[torch.Tensor]  # holds the piece read from SSD; None: the states are in host memory


# Piece buffers the rotation needs (see the module doc): the piece read, the one in Adam, the one written.
ROTATION_PIECES = 3


class UpdateBuffers:
    """Aligned host buffers of ``store``; one set per executing process: ``ROTATION_PIECES`` piece buffers
    plus ``read_ahead_pieces`` more (none when every layer's states are in host memory), a gradient buffer
    for the largest layer whose gradient comes through SSD (none when all are in host memory), and two
    buffers for the new weights of the largest layer (one written while the next update casts into the
    other)."""

    def __init__(self, store: SsdStore, largest_numel: int, largest_ssd_state_piece_numel: int,
                 largest_ssd_grad_numel: int, read_ahead_pieces: int = 0):
        piece_bytes = padded_size(12 * largest_ssd_state_piece_numel)
        count = ROTATION_PIECES + read_ahead_pieces
        self.pieces = [store.buffer(piece_bytes) for _ in range(count)] if largest_ssd_state_piece_numel else []
        self.grad = store.buffer(padded_size(4 * largest_ssd_grad_numel)) if largest_ssd_grad_numel else None
        self.params = [store.buffer(padded_size(4 * largest_numel)) for _ in range(2)]


class UpdatePipeline:
    """Queued updates, executed in order, piece by piece, with the next read in flight (see module doc)."""

    def __init__(self, store: SsdStore, kernel: CpuAdamKernel, buffers: UpdateBuffers, host: SharedHostMemory):
        self._store, self._kernel, self._buffers, self._host = store, kernel, buffers, host
        self._queue: Deque = deque()            # tasks with pieces still to read; the head is being read
        self._next_piece = 0                    # the head's next piece to read
        self._current: Optional[_Piece] = None  # read issued (or in host memory): Adam runs at the next step
        self._writing_buffer: Optional[torch.Tensor] = None  # the piece buffer writes are issued from
        self._completing: List = []             # updates whose last writes are in flight
        self._params_buffer = {}                # task_id -> the weight buffer its pieces are cast into
        self._next_params_buffer = 0
        self._io_bytes = {}                     # task_id -> [read, written, of which read ahead], counted at issue
        self._started = {}                      # task_id -> when its first piece was issued
        self._last_completion = time.perf_counter()
        self._hints: Deque[ReadAheadPiece] = deque()  # pieces the next updates read first, in their order
        self._read_ahead: Dict[Tuple[int, int], Tuple[Region, torch.Tensor]] = {}  # (layer, index) -> read early
        # The rotation's buffers always stay: the piece in Adam, the one written, the one read.
        self._read_ahead_limit = max(0, len(buffers.pieces) - ROTATION_PIECES)
        self._orphan_read_bytes = 0  # read ahead, then discarded: reported with the next result

    def add(self, task) -> None:
        """Queue an update, earliest deadline first: the next forward needs layer 0's new weights first, so
        queued updates run in layer order (a started one finishes first). Updates of different layers
        are independent, and every update of one step completes before any of the next step is queued
        (each layer's fetch waits for its update), so the order changes no result."""
        position = len(self._queue)
        while position > (1 if self._next_piece > 0 else 0) and self._queue[position - 1].layer > task.layer:
            position -= 1
        self._queue.insert(position, task)
        if self._current is None:
            self._current = self._issue_next_read()

    def idle(self) -> bool:
        return self._current is None and not self._completing and not self._queue

    def advance(self) -> List[UpdateResult]:
        """One step: wait for the piece read last time, issue the next read, run Adam on the piece while the
        writes issued last time are in flight, wait for those, issue this piece's writes. Returns the
        results of the updates whose writes completed."""
        self._store.wait_reads()
        piece, self._current = self._current, None
        if piece is not None:
            # The next read goes out before Adam runs, so the SSD is not idle meanwhile, unless it would
            # overwrite the gradient buffer this piece still reads (a new update whose gradient is on SSD),
            # or no buffer is free (the writes in flight hold one, spare buffers hold pieces read ahead).
            if self._next_read_can_start_before(piece) and self._next_read_has_a_buffer(busy=piece.buffer):
                self._current = self._issue_next_read(busy=piece.buffer)
            self._compute(piece)
        self._store.wait_writes()
        self._writing_buffer = None
        finished = self._report_completed()
        if piece is not None:
            self._issue_writes(piece)
            if self._current is None:
                self._current = self._issue_next_read()
        return finished

    def _next_read_can_start_before(self, piece: _Piece) -> bool:
        if not self._queue:
            return False
        upcoming = self._queue[0]
        return upcoming is piece.task or upcoming.grad is None

    def _next_read_has_a_buffer(self, busy: torch.Tensor) -> bool:
        """The next piece needs no piece buffer (its states are in host memory, or were read ahead), or one is
        free."""
        task = self._queue[0]
        if task.state_in is None or (task.layer, self._next_piece) in self._read_ahead:
            return True
        return self._free_buffer(busy) is not None

    def drain(self) -> List[UpdateResult]:
        finished = []
        while not self.idle():
            finished.extend(self.advance())
        return finished

    def hint(self, pieces: Sequence[ReadAheadPiece]) -> None:
        """The pieces the next updates will read first, in the order those updates will come; replaces
        the previous hint. What was already read ahead stays until used or found stale."""
        self._hints = deque(pieces[:self._read_ahead_limit])

    def read_ahead(self) -> bool:
        """While nothing is queued or in flight (every update so far written, so the committed states on
        SSD are final): read the next hinted piece into a spare piece buffer, and wait for it. One piece
        at a time, so that an update arriving meanwhile waits for one piece read at most, not for every
        one (the aio handle can only wait for all it has in flight). False: nothing to read."""
        while self.idle() and self._hints and len(self._read_ahead) < self._read_ahead_limit:
            hint = self._hints.popleft()
            key = (hint.layer, hint.index)
            if key in self._read_ahead:
                if _same_version(self._read_ahead[key][0], hint.region):
                    continue
                self._discard_read_ahead(key)
            buffer = self._free_buffer()
            self._store.read(hint.region, buffer)  # checked (tag) before it can be used
            self._read_ahead[key] = (hint.region, buffer)
            return True
        return False

    def cancel_read_ahead(self) -> List[UpdateResult]:
        """Forget hints and pieces read ahead, with no read left in flight: before the training process
        rewrites committed states itself (loading a checkpoint)."""
        self._hints.clear()
        for key in list(self._read_ahead):
            self._discard_read_ahead(key)
        return []

    def abandon(self) -> list:
        """After a failure: every update held, in order; the pipeline is left empty, with no transfer in
        flight (an aio handle destroyed with pending reads aborts the process)."""
        try:
            self._store.wait()
        except Exception:  # the failure being handled is the one worth reporting
            pass
        held = list(task for task in self._completing)
        if self._current is not None:
            held.append(self._current.task)
        held.extend(task for task in self._queue if task not in held)
        self._queue.clear()
        self._current, self._completing, self._next_piece = None, [], 0
        self._writing_buffer = None
        self._params_buffer.clear()
        self._hints.clear()
        self._orphan_read_bytes += sum(region.padded_bytes for region, _ in self._read_ahead.values())
        self._read_ahead.clear()
        return held

    # ------------------------------------------------------------------ steps of one piece

    def _issue_next_read(self, busy: Optional[torch.Tensor] = None) -> Optional[_Piece]:
        """The next piece, its read in flight, in a piece buffer neither written from nor ``busy``."""
        if not self._queue:
            return None
        task = self._queue[0]
        ranges = piece_ranges(task.numel, task.piece_numel) if task.state_in is not None else [(0, task.numel)]
        index = self._next_piece
        start, stop = ranges[index]
        self._next_piece += 1
        if self._next_piece == len(ranges):
            self._queue.popleft()
            self._next_piece = 0
        if index == 0:
            self._started[task.task_id] = time.perf_counter()
            self._io_bytes[task.task_id] = [0, 0, 0]
            # The other weight buffer than the update before: that one may still be written from.
            self._params_buffer[task.task_id] = self._buffers.params[self._next_params_buffer]
            self._next_params_buffer = 1 - self._next_params_buffer
            if task.grad is not None:
                self._read(task, task.grad, self._buffers.grad)
        buffer = None
        if task.state_in is not None:
            buffer = self._take_read_ahead(task, index)
            if buffer is None:
                buffer = self._free_buffer(busy)
                # The rotation's three buffers leave one free here: at most one is written from, one ``busy``.
                assert buffer is not None, "no piece buffer free for the next read"
                self._read(task, task.state_in[index], buffer)
        return _Piece(task, index, start, stop, buffer)

    def _free_buffer(self, busy: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """A piece buffer neither written from, ``busy``, nor holding a piece read ahead; None if there is none
        (only while writes are in flight: the rotation has a buffer for each of the other three)."""
        taken = [buffer for _, buffer in self._read_ahead.values()] + [self._writing_buffer, busy]
        return next((b for b in self._buffers.pieces if not any(b is other for other in taken)), None)

    def _take_read_ahead(self, task, index: int) -> Optional[torch.Tensor]:
        """The buffer holding this piece if it was read ahead, and is still what the update reads."""
        key = (task.layer, index)
        if key not in self._read_ahead:
            return None
        region, buffer = self._read_ahead[key]
        if not _same_version(region, task.state_in[index]):
            self._discard_read_ahead(key)
            return None
        del self._read_ahead[key]
        self._io_bytes[task.task_id][0] += region.padded_bytes
        self._io_bytes[task.task_id][2] += region.padded_bytes
        return buffer

    def _discard_read_ahead(self, key: Tuple[int, int]) -> None:
        # No read ahead is ever in flight here: ``read_ahead`` waits for each.
        region, _ = self._read_ahead.pop(key)
        self._orphan_read_bytes += region.padded_bytes

    def _compute(self, piece: _Piece) -> None:
        task, count = piece.task, piece.stop - piece.start
        if piece.buffer is not None:
            states = piece.buffer[:12 * count].view(torch.float32)
        else:
            states = self._host.optimizer_states.slot(task.layer, 3 * task.numel)
        master, exp_avg, exp_avg_sq = states[:count], states[count:2 * count], states[2 * count:3 * count]
        if not task.recast_only:
            self._kernel.update(task.step, task.hyper, master, self._gradient_piece(piece), exp_avg, exp_avg_sq)
        element_bytes = torch.empty(0, dtype=task.compute_dtype).element_size()
        params = self._params_buffer[task.task_id][:element_bytes * task.numel].view(task.compute_dtype)
        params[piece.start:piece.stop].copy_(master)

    def _gradient_piece(self, piece: _Piece) -> torch.Tensor:
        """The piece's fp32 gradient, clipped. A bf16 gradient (bf16 accumulation) is cast exactly."""
        task = piece.task
        if task.grad is not None:
            element_bytes = torch.empty(0, dtype=task.grad_dtype).element_size()
            grads = self._buffers.grad[:element_bytes * task.numel].view(task.grad_dtype)[piece.start:piece.stop]
            if grads.dtype != torch.float32:
                grads = grads.float()
        else:
            grads = self._host.gradients.slot(task.layer, task.numel)[piece.start:piece.stop]
        if task.clip_coefficient != 1.0:
            grads.mul_(task.clip_coefficient)
        return grads

    def _issue_writes(self, piece: _Piece) -> None:
        task = piece.task
        if piece.buffer is not None and task.state_out is not None:
            self._write(task, task.state_out[piece.index], piece.buffer)
            self._writing_buffer = piece.buffer
        last = piece.index == len(task.state_in) - 1 if task.state_in is not None else True
        if last:
            # Every piece has been cast into the weight buffer: the layer's new weights go out whole.
            self._write(task, task.param_out, self._params_buffer.pop(task.task_id))
            self._completing.append(task)

    def _report_completed(self) -> List[UpdateResult]:
        finished = []
        now = time.perf_counter()
        for task in self._completing:
            # Busy time, not overlapping spans: from when this update started or the previous ended.
            seconds = now - max(self._started.pop(task.task_id), self._last_completion)
            read, written, read_ahead = self._io_bytes.pop(task.task_id)
            # Bytes read ahead and discarded were read all the same: counted with the next result.
            read, self._orphan_read_bytes = read + self._orphan_read_bytes, 0
            finished.append(UpdateResult(task.task_id, seconds, read, written, bytes_read_ahead=read_ahead))
            self._last_completion = now
        self._completing = []
        return finished

    def _read(self, task, region: Region, buffer: torch.Tensor) -> None:
        self._store.start_read(region, buffer)
        self._io_bytes[task.task_id][0] += region.padded_bytes

    def _write(self, task, region: Region, buffer: torch.Tensor) -> None:
        self._store.start_write(region, buffer)
        self._io_bytes[task.task_id][1] += region.padded_bytes


def _same_version(region: Region, other: Region) -> bool:
    return region.region_id == other.region_id and region.generation == other.generation
