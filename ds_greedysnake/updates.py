"""Per-layer Adam updates, run inline or in a worker process, each with a completion handle.

An update is plain data (``UpdateTask``): which regions to read (fp32 master, moments, gradient),
which to write (the other state slot, the other parameter slot) and the step's decision. States and
gradients kept in host memory shared with the worker (``host_memory.py``) are named by the layer. The same
``execute_update`` runs it in the main process (overlap off) or in a worker process (overlap on):
DeepSpeedCPUAdam holds the GIL, so a thread would block training, while a process runs truly in
parallel with its own aio handle (the aio handle and buffers are not shared between processes).
"""
import copy
import os
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional

import torch

from .deepspeed_compat import AdamHyperparameters, CpuAdamKernel
from .host_memory import SharedHostMemory
from .ssd import IoCounters, Region, SsdStore, padded_size

_WORKER_POLL_SECONDS = 1.0


@dataclass
class UpdateTask:
    task_id: int
    layer: int
    numel: int
    compute_dtype: torch.dtype
    state_in: Optional[Region]   # [fp32 master | exp_avg | exp_avg_sq] as committed; None: in host memory
    state_out: Optional[Region]  # the other slot, written with the updated states; None: updated in place
    grad: Optional[Region]  # fp32 gradient accumulated over the step; None: in the layer's arena slot
    param_out: Region      # the layer's other parameter slot, written in the compute dtype
    step: int
    hyper: AdamHyperparameters
    clip_coefficient: float


@dataclass
class ReplayTask:
    """Bring the executing kernel's step history to ``last_step`` (after loading a checkpoint)."""
    last_step: int
    hyper: AdamHyperparameters


@dataclass
class UpdateResult:
    task_id: int
    seconds: float
    bytes_read: int
    bytes_written: int
    error: Optional[str] = None


class BufferSizes(NamedTuple):
    """Element counts the update buffers are sized for (see ``UpdateBuffers``)."""
    largest_numel: int
    largest_ssd_state_numel: int
    largest_ssd_grad_numel: int


def plan_write(region: Region) -> Region:
    """The copy of ``region`` a task carries; the caller's copy moves to the generation the write will stamp.

    The writer (possibly another process) increments its copy's generation when it writes, so both
    copies agree on the tag without sharing memory.
    """
    carried = copy.copy(region)
    region.generation += 1
    return carried


class UpdateBuffers:
    """Aligned host buffers of ``store`` for the largest layer; one set per executing process. The state
    and gradient buffers are sized for the largest layer whose states / gradient go through SSD (none
    when every layer has a slot in the shared host arena)."""

    def __init__(self, store: SsdStore, largest_numel: int, largest_ssd_state_numel: int,
                 largest_ssd_grad_numel: int):
        self.state = store.buffer(padded_size(12 * largest_ssd_state_numel)) if largest_ssd_state_numel else None
        self.grad = store.buffer(padded_size(4 * largest_ssd_grad_numel)) if largest_ssd_grad_numel else None
        self.params = store.buffer(padded_size(4 * largest_numel))


def execute_update(task: UpdateTask, store: SsdStore, kernel: CpuAdamKernel, buffers: UpdateBuffers,
                   host: SharedHostMemory) -> UpdateResult:
    started = time.perf_counter()
    read_before = sum(store.counters.bytes_read.values())
    written_before = sum(store.counters.bytes_written.values())
    assert (task.state_in is None) == (task.state_out is None), task
    # Both reads in flight together, then both writes: the SSD sees deep queues.
    if task.state_in is not None:
        store.start_read(task.state_in, buffers.state)
    if task.grad is not None:
        store.start_read(task.grad, buffers.grad)
    store.wait()
    if task.state_in is not None:
        states = buffers.state[:12 * task.numel].view(torch.float32)
    else:
        states = host.optimizer_states.slot(task.layer, 3 * task.numel)
    master, exp_avg, exp_avg_sq = states[:task.numel], states[task.numel:2 * task.numel], states[2 * task.numel:]
    if task.grad is not None:
        grads = buffers.grad[:4 * task.numel].view(torch.float32)
    else:
        grads = host.gradients.slot(task.layer, task.numel)
    if task.clip_coefficient != 1.0:
        grads.mul_(task.clip_coefficient)
    kernel.update(task.step, task.hyper, master, grads, exp_avg, exp_avg_sq)
    if task.state_out is not None:
        store.start_write(task.state_out, buffers.state)
    element_bytes = torch.empty(0, dtype=task.compute_dtype).element_size()
    buffers.params[:element_bytes * task.numel].view(task.compute_dtype).copy_(master)
    store.start_write(task.param_out, buffers.params)
    store.wait()
    return UpdateResult(task.task_id, time.perf_counter() - started,
                        sum(store.counters.bytes_read.values()) - read_before,
                        sum(store.counters.bytes_written.values()) - written_before)


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
        self.wait_seconds = 0.0       # time the training loop spent blocked on updates
        self.update_seconds = 0.0     # time the updates themselves took
        self._pending: Dict[int, UpdateHandle] = {}

    def submit(self, task: UpdateTask) -> UpdateHandle:
        raise NotImplementedError

    def replay(self, task: ReplayTask) -> None:
        """Runs in order with the updates (call after ``drain``)."""
        raise NotImplementedError

    def poll(self) -> None:
        pass

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
        self.counters.bytes_read["optimizer_worker"] += result.bytes_read
        self.counters.bytes_written["optimizer_worker"] += result.bytes_written


class InlineUpdater(Updater):
    """Runs each update at submission, in this process: the non-overlapped step."""

    def __init__(self, store: SsdStore, kernel: CpuAdamKernel, sizes: "BufferSizes", host: SharedHostMemory):
        super().__init__(store.counters)
        self._store, self._kernel, self._host = store, kernel, host
        self._buffers = UpdateBuffers(store, *sizes)

    def submit(self, task: UpdateTask) -> UpdateHandle:
        handle = UpdateHandle(self, task)
        started = time.perf_counter()
        result = execute_update(task, self._store, self._kernel, self._buffers, self._host)
        self.wait_seconds += time.perf_counter() - started
        handle.result = result
        self.update_seconds += result.seconds
        return handle

    def replay(self, task: ReplayTask) -> None:
        self._kernel.replay_steps(task.last_step, task.hyper)

    def wait_for(self, handle: UpdateHandle) -> None:
        raise AssertionError("inline updates complete at submission")


def worker_main(task_fd: int, result_fd: int) -> None:
    """The worker process: set up from the first message, then run tasks in order until ``None``."""
    tasks, results = Connection(task_fd, writable=False), Connection(result_fd, readable=False)
    folder, ds_config, hyper, adamw_mode, sizes, num_threads, host_layouts = tasks.recv()
    torch.set_num_threads(num_threads)
    store = SsdStore(folder, ds_config, IoCounters(), "worker")
    host = SharedHostMemory.attach(host_layouts)
    kernel = CpuAdamKernel(hyper, adamw_mode)
    buffers = UpdateBuffers(store, *sizes)
    results.send("ready")
    while True:
        try:
            task = tasks.recv()
        except EOFError:
            return  # the training process is gone
        if task is None:
            return
        if isinstance(task, ReplayTask):
            kernel.replay_steps(task.last_step, task.hyper)
            continue
        try:
            result = execute_update(task, store, kernel, buffers, host)
        except Exception:  # reported to the training process, which raises it with the layer named
            result = UpdateResult(task.task_id, 0.0, 0, 0, traceback.format_exc())
        results.send(result)


class WorkerUpdater(Updater):
    """Runs updates in order in one worker process, while training goes on.

    The worker is a fresh interpreter (``python -m ds_greedysnake.update_worker``) talking over two pipes:
    multiprocessing's spawn would re-run the user's training script in the child when it has no
    ``if __name__ == "__main__"`` guard, and fork would copy torch's threads and locks.
    """

    def __init__(self, counters: IoCounters, folder: str, ds_config: dict, hyper: AdamHyperparameters,
                 adamw_mode: bool, sizes: "BufferSizes", num_threads: int, host: SharedHostMemory,
                 start_timeout: float = 300.0):
        super().__init__(counters)
        task_read, task_write = os.pipe()
        result_read, result_write = os.pipe()
        shared_fds = (task_read, result_write) + host.fds()
        self._process = subprocess.Popen([sys.executable, "-m", "ds_greedysnake.update_worker", str(task_read),
                                          str(result_write)], pass_fds=shared_fds)
        os.close(task_read)
        os.close(result_write)
        self._tasks = Connection(task_write, readable=False)
        self._results = Connection(result_read, writable=False)
        self._tasks.send((folder, ds_config, hyper, adamw_mode, tuple(sizes), num_threads, host.layouts()))
        self._receive(timeout=start_timeout, expecting="the worker to start")

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

    def __del__(self):
        if getattr(self, "_process", None) is not None and self._process.poll() is None:
            self._process.kill()

    def _receive(self, timeout: Optional[float], expecting: str):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._results.poll(_WORKER_POLL_SECONDS):
            self._raise_if_dead(expecting)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the greedysnake optimizer worker did not answer within {timeout:.0f} s "
                                   f"while training waited for {expecting}")
        return self._results.recv()

    def _raise_if_dead(self, expecting: str) -> None:
        if self._process.poll() is not None:
            raise RuntimeError(f"the greedysnake optimizer worker (pid {self._process.pid}) exited with code "
                               f"{self._process.returncode} while training waited for {expecting}; the step's "
                               "updates are lost: load the last checkpoint")
