"""Per-layer Adam updates, run inline or in a worker process, each with a completion handle.

An update is plain data (``UpdateTask``): which regions to read (fp32 master, moments, gradient),
which to write (the other state and parameter slots, or the same ones for a layer updated in place,
ssd_layout.py) and the step's decision. States and
gradients kept in host memory shared with the worker (``host_memory.py``) are named by the layer. The same
``UpdatePipeline`` (``update_pipeline.py``) runs updates in the main process (overlap off) or in a
worker process (overlap on): DeepSpeedCPUAdam holds the GIL, so a thread would block training, while a
process runs truly in parallel with its own aio handle (the aio handle and buffers are not shared
between processes).
"""
import copy
import os
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch

from .. import deepspeed_compat
from ..deepspeed_compat import AdamHyperparameters, CpuAdamKernel
from ..storage.host_memory import SharedHostMemory
from ..storage.io_trace import RESULT_PIPE, TASK_PIPE, TRAIN, WORKER, IoEvent, IoRecorder
from ..storage.ssd import IoCounters, Region, SsdStore
from .update_pipeline import ReadAheadPiece, UpdateBuffers, UpdatePipeline, UpdateResult

_WORKER_POLL_SECONDS = 1.0


@dataclass
class UpdateTask:
    task_id: int
    layer: int
    numel: int
    compute_dtype: torch.dtype
    # The pieces of [fp32 master | exp_avg | exp_avg_sq] (update_pipeline.py) as committed; None: in host memory.
    state_in: Optional[List[Region]]
    # Where the updated states go: the other slot's pieces, or for a one-slot layer (ssd_layout.py) the same
    # pieces (copies carrying the next generation); None: in host memory, updated in place (or a recast).
    state_out: Optional[List[Region]]
    piece_numel: int                   # elements per piece (the last may be shorter)
    grad: Optional[Region]  # fp32 gradient accumulated over the step; None: in the layer's arena slot
    param_out: Region      # the parameter slot written, in the compute dtype: the other one, or the only one
    step: int
    hyper: AdamHyperparameters
    clip_coefficient: float
    grad_dtype: torch.dtype = torch.float32  # of ``grad`` on SSD: bf16 when the gradient is accumulated in bf16
    # No Adam: only rewrite the weights (``param_out``) from the committed fp32 master, after a skipped step
    # found the gradient written over them (ssd_layout.py); ``grad`` and ``state_out`` are None.
    recast_only: bool = False


@dataclass
class ReplayTask:
    """Bring the executing kernel's step history to ``last_step`` (after loading a checkpoint)."""
    last_step: int
    hyper: AdamHyperparameters


@dataclass
class ReadAhead:
    """The pieces the next step's updates read first, in order (``UpdatePipeline.hint``)."""
    pieces: List[ReadAheadPiece]


@dataclass
class CancelReadAhead:
    """Drop hints and pieces read ahead; the worker answers ``Ack`` once no read of theirs is in flight."""


@dataclass
class Ack:
    what: str


@dataclass
class TraceIo:
    """Start (``on``) or stop recording the worker's SSD operations (io_trace.py); stopping answers ``TracedIo``."""
    on: bool


@dataclass
class TracedIo:
    events: List[IoEvent]


class _Pipe:
    """One end of a pipe between the processes, numbering its messages (both ends count every message,
    so message n is the same on both) and telling the recorder about them."""

    def __init__(self, connection: Connection, name: str, recorder: IoRecorder):
        self.connection, self.name, self.recorder = connection, name, recorder
        self.count = 0

    def send(self, message) -> None:
        self.connection.send(message)
        self.count += 1
        self.recorder.message("send", self.name, self.count)

    def recv(self, started: Optional[float] = None):
        """The next message; ``started``: when the caller began waiting for it (a blocking receive)."""
        message = self.connection.recv()
        self.count += 1
        self.recorder.message("recv", self.name, self.count, started)
        return message

    def poll(self, timeout: float = 0.0) -> bool:
        return self.connection.poll(timeout)

    def close(self) -> None:
        self.connection.close()


class BufferSizes(NamedTuple):
    """Element counts the update buffers are sized for, and how many spare piece buffers the read-ahead
    gets (see ``UpdateBuffers``)."""
    largest_numel: int
    largest_ssd_state_piece_numel: int
    largest_ssd_grad_numel: int
    read_ahead_pieces: int = 0


def plan_write(region: Region) -> Region:
    """The copy of ``region`` a task carries; the caller's copy moves to the generation the write will stamp.

    The writer (possibly another process) increments its copy's generation when it writes, so both
    copies agree on the tag without sharing memory.
    """
    carried = copy.copy(region)
    region.generation += 1
    return carried


class UpdateHandle:
    """Completion of one submitted update; ``wait`` is idempotent."""

    def __init__(self, updater: "Updater", task: UpdateTask):
        self._updater = updater
        self.task = task
        self.result: Optional[UpdateResult] = None

    def done(self) -> bool:
        if self.result is None:
            self._updater.poll()
        return self.result is not None

    def wait(self) -> UpdateResult:
        if self.result is None:
            self._updater.wait_for(self)
        return self.result


class Updater:
    """Where updates run. Subclasses: inline (synchronous) and a worker process."""

    def __init__(self, counters: IoCounters):
        self.counters = counters
        self.recorder = IoRecorder(TRAIN)  # the engine's, while a trace is on
        self.wait_seconds = 0.0       # time the training loop spent blocked on updates
        self.update_seconds = 0.0     # time the updates themselves took
        self.bytes_read_ahead = 0     # state bytes the worker read before their update came
        self._pending: Dict[int, UpdateHandle] = {}

    def submit(self, task: UpdateTask) -> UpdateHandle:
        raise NotImplementedError

    def replay(self, task: ReplayTask) -> None:
        """Runs in order with the updates (call after ``drain``)."""
        raise NotImplementedError

    def poll(self) -> None:
        pass

    def read_ahead(self, pieces: Sequence[ReadAheadPiece]) -> None:
        """Hint the pieces the next step's updates read first; only a worker has time to use it."""

    def cancel_read_ahead(self) -> None:
        """Returns once nothing read ahead is held or in flight (before rewriting committed states)."""

    def start_io_trace(self) -> None:
        """Where updates run in another process: record its SSD operations there too."""

    def stop_io_trace(self) -> List[IoEvent]:
        """The other process's recorded events (none inline: they are the training process's)."""
        return []

    def wait_for(self, handle: UpdateHandle) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        for handle in list(self._pending.values()):
            handle.wait()

    def close(self) -> None:
        pass

    def _complete(self, result: UpdateResult) -> None:
        handle = self._pending.pop(result.task_id)
        if result.error is not None:
            raise RuntimeError(f"optimizer update of layer {handle.task.layer} failed in the worker:\n{result.error}")
        handle.result = result
        self.update_seconds += result.seconds
        self.bytes_read_ahead += result.bytes_read_ahead
        self.counters.bytes_read["optimizer_worker"] += result.bytes_read
        self.counters.bytes_written["optimizer_worker"] += result.bytes_written


class InlineUpdater(Updater):
    """Runs each update at submission, in this process: the non-overlapped step."""

    def __init__(self, store: SsdStore, kernel: CpuAdamKernel, sizes: BufferSizes, host: SharedHostMemory):
        super().__init__(store.counters)
        self._kernel = kernel
        self._pipeline = UpdatePipeline(store, kernel, UpdateBuffers(store, *sizes), host)

    def submit(self, task: UpdateTask) -> UpdateHandle:
        handle = UpdateHandle(self, task)
        started = time.perf_counter()
        self._pipeline.add(task)
        try:
            (result,) = self._pipeline.drain()
        except BaseException:
            self._pipeline.abandon()
            raise
        self.wait_seconds += time.perf_counter() - started
        handle.result = result
        self.update_seconds += result.seconds
        return handle

    def replay(self, task: ReplayTask) -> None:
        self._kernel.replay_steps(task.last_step, task.hyper)

    def wait_for(self, handle: UpdateHandle) -> None:
        raise AssertionError("inline updates complete at submission")


# Set in the worker's environment: it never needs a GPU (Adam runs on the CPU, its buffers are host memory).
# Without them it would detect CUDA, and its first pinned buffer would create a CUDA context on GPU 0 for
# every rank (0.3-0.5 GB each; an error under the EXCLUSIVE_PROCESS compute mode). With DeepSpeed's CPU
# accelerator its buffers are locked by its aio handle (mlock), never pinned through torch.
WORKER_HIDDEN_ACCELERATORS = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "",
                              "DS_ACCELERATOR": deepspeed_compat.WORKER_ACCELERATOR}


def _device_type(device_type: Optional[str]) -> str:
    if device_type is None:
        from deepspeed.accelerator import get_accelerator
        device_type = get_accelerator().device_name()
    return device_type


def worker_environment(base: Optional[Dict[str, str]] = None, device_type: Optional[str] = None) -> Dict[str, str]:
    """The optimizer worker's environment: the training process's (``base``), with every accelerator hidden.

    Off the CPU accelerator (``device_type``, default this process's) the worker's ops are the CPU ones
    set-up built (``deepspeed_compat.check_worker_ops``, checked before it starts) and it may compile none:
    a compile there would take minutes of every core at its first start, against its start timeout."""
    env = dict(os.environ if base is None else base, **WORKER_HIDDEN_ACCELERATORS)
    if _device_type(device_type) != "cpu":
        env[deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV] = "1"
    return env


def _check_no_accelerator() -> None:
    from deepspeed.accelerator import get_accelerator
    name = get_accelerator().device_name()
    if name != "cpu":
        raise RuntimeError(f"the greedysnake optimizer worker found the {name} accelerator; it must run on DeepSpeed's "
                           f"CPU accelerator (it is started with {WORKER_HIDDEN_ACCELERATORS})")


def worker_main(task_fd: int, result_fd: int) -> None:
    """The worker process: set up from the first message, then run tasks in order until ``None``. It
    takes new tasks whenever they are there, so that the next update's first read is in flight while
    the current one finishes."""
    recorder = IoRecorder(WORKER)
    tasks = _Pipe(Connection(task_fd, writable=False), TASK_PIPE, recorder)
    results = _Pipe(Connection(result_fd, readable=False), RESULT_PIPE, recorder)
    folder, aio, hyper, adamw_mode, sizes, num_threads, host_layouts = tasks.recv()
    _check_no_accelerator()
    torch.set_num_threads(num_threads)
    store = SsdStore(folder, aio, IoCounters(), "worker", recorder=recorder)
    kernel = CpuAdamKernel(hyper, adamw_mode)
    pipeline = UpdatePipeline(store, kernel, UpdateBuffers(store, *sizes), SharedHostMemory.attach(host_layouts))
    results.send("ready")
    while True:
        # Block for a message only when no update is in flight; idle, read ahead first.
        while pipeline.idle() or tasks.poll():
            if pipeline.idle() and not tasks.poll() and _read_ahead(pipeline):
                continue
            try:
                message = tasks.recv()
            except EOFError:
                message = None  # the training process is gone
            if message is None:
                pipeline.abandon()  # an aio handle destroyed with reads in flight aborts the process
                return
            if isinstance(message, ReplayTask):
                _send_all(results, _guarded(pipeline, pipeline.drain))
                kernel.replay_steps(message.last_step, message.hyper)
            elif isinstance(message, ReadAhead):
                pipeline.hint(message.pieces)
            elif isinstance(message, CancelReadAhead):
                _send_all(results, _guarded(pipeline, pipeline.cancel_read_ahead))
                results.send(Ack("read-ahead cancelled"))
            elif isinstance(message, TraceIo):
                if message.on:
                    recorder.start()
                else:
                    events = recorder.stop()
                    results.send(TracedIo(events))
            else:
                pipeline.add(message)
        _send_all(results, _guarded(pipeline, pipeline.advance))


def _read_ahead(pipeline: UpdatePipeline) -> bool:
    """One piece read ahead. A failure here belongs to no update: it is reported on stderr, what was read
    ahead is dropped, and the updates read their states themselves (and fail loudly if the SSD does)."""
    try:
        return pipeline.read_ahead()
    except Exception:
        print(f"greedysnake optimizer worker: reading ahead failed, continuing without:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        pipeline.abandon()
        return False


def _guarded(pipeline: UpdatePipeline, action) -> List[UpdateResult]:
    """Results of ``action``; if it fails, an error result for every update the pipeline held, which the
    training process raises with the layer named."""
    try:
        return action()
    except Exception:
        error = traceback.format_exc()
        return [UpdateResult(task.task_id, 0.0, 0, 0, error) for task in pipeline.abandon()]


def _send_all(results: _Pipe, finished: List[UpdateResult]) -> None:
    for result in finished:
        results.send(result)


class WorkerUpdater(Updater):
    """Runs updates in order in one worker process, while training goes on.

    The worker is a fresh interpreter (``python -m ds_greedysnake.optim.update_worker``) talking over two pipes:
    multiprocessing's spawn would re-run the user's training script in the child when it has no
    ``if __name__ == "__main__"`` guard, and fork would copy torch's threads and locks.
    """

    def __init__(self, counters: IoCounters, folder: str, aio: deepspeed_compat.AioSettings,
                 hyper: AdamHyperparameters, adamw_mode: bool, sizes: "BufferSizes", num_threads: int,
                 host: SharedHostMemory, start_timeout: float = 300.0):
        super().__init__(counters)
        if _device_type(None) != "cpu":
            deepspeed_compat.check_worker_ops()  # here, with the set-up command, not as a failed start
        task_read, task_write = os.pipe()
        result_read, result_write = os.pipe()
        shared_fds = (task_read, result_write) + host.fds()
        self._process = subprocess.Popen([sys.executable, "-m", "ds_greedysnake.optim.update_worker", str(task_read),
                                          str(result_write)], pass_fds=shared_fds, env=worker_environment())
        os.close(task_read)
        os.close(result_write)
        self._tasks = _Pipe(Connection(task_write, readable=False), TASK_PIPE, self.recorder)
        self._results = _Pipe(Connection(result_read, writable=False), RESULT_PIPE, self.recorder)
        try:
            self._tasks.send((folder, aio, hyper, adamw_mode, tuple(sizes), num_threads, host.layouts()))
            self._receive(timeout=start_timeout, expecting="the worker to start")
        except BaseException:
            self._abandon()  # a worker that did not start is not left running, nor its pipes open
            raise

    def submit(self, task: UpdateTask) -> UpdateHandle:
        handle = UpdateHandle(self, task)
        try:
            self._tasks.send(task)
        except OSError:
            self._raise_if_dead(f"layer {task.layer}'s update to be accepted")
            raise
        self._pending[task.task_id] = handle
        return handle

    def replay(self, task: ReplayTask) -> None:
        self._tasks.send(task)

    def poll(self) -> None:
        while self._results.poll():
            self._complete(self._results.recv())

    def read_ahead(self, pieces: Sequence[ReadAheadPiece]) -> None:
        self._tasks.send(ReadAhead(list(pieces)))

    def cancel_read_ahead(self) -> None:
        self._tasks.send(CancelReadAhead())
        self._receive_answer(Ack, "the read-ahead to stop")

    def start_io_trace(self) -> None:
        self._tasks.send(TraceIo(True))

    def stop_io_trace(self) -> List[IoEvent]:
        self._tasks.send(TraceIo(False))
        return self._receive_answer(TracedIo, "its I/O trace").events

    def _receive_answer(self, kind: type, expecting: str):
        """The worker's next message of ``kind``, completing the update results that come before it."""
        while not isinstance(message := self._receive(timeout=None, expecting=expecting), kind):
            self._complete(message)
        return message

    def wait_for(self, handle: UpdateHandle) -> None:
        started = time.perf_counter()
        while handle.result is None:
            self._complete(self._receive(timeout=None, expecting=f"layer {handle.task.layer}'s update"))
        self.wait_seconds += time.perf_counter() - started

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._tasks.send(None)
                self._process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
        self._tasks.close()
        self._results.close()

    def _abandon(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._tasks.close()
        self._results.close()

    def __del__(self):
        if getattr(self, "_process", None) is not None and self._process.poll() is None:
            self._process.kill()

    def _receive(self, timeout: Optional[float], expecting: str):
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        while not self._results.poll(_WORKER_POLL_SECONDS):
            self._raise_if_dead(expecting)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the greedysnake optimizer worker did not answer within {timeout:.0f} s "
                                   f"while training waited for {expecting}")
        return self._results.recv(started)

    def _raise_if_dead(self, expecting: str) -> None:
        if self._process.poll() is not None:
            raise RuntimeError(f"the greedysnake optimizer worker (pid {self._process.pid}) exited with code "
                               f"{self._process.returncode} while training waited for {expecting}; the step's "
                               "updates are lost: load the last checkpoint")
