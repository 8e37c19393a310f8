"""A recorded step's SSD operations replayed with no compute and no Adam: the step's I/O floor.

Each process of the record (``io_trace.py``) is replayed by a thread of its own, with aio handles of its
own: one per handle of the record (each store's reads "r0", "r1", ... and its writes "w"), made from the
same aio settings, so the same queue depth, block size and threads. A thread issues its process's transfers
in their recorded order, each region whole, in the same chunks as ``SsdStore`` issues them, to the same
file, on the handle it went to; it waits where the process waited, on the handles it waited on (so the
same transfers are in flight together), and it passes a receive of message n on a pipe only once the
other thread has passed that message's send (so an update's reads start only after training asked for
them, and training's reads of new weights only after the update said it was done). A message whose
other end lies outside the record does not hold anything up. What is left is the time of the transfers
themselves: compute, Adam, Python and the pipes' latency are gone.

The replay writes over the record's files (with whatever its buffer holds): run it only on a run that is
finished (after ``engine.close()``), as the A/B benchmark does. DeepSpeed's aio wait releases the GIL,
so the two threads' transfers are in flight together as the two processes' were.
"""
import errno
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from .. import deepspeed_compat
from .io_trace import IoEvent, IoTrace
from .ssd import SsdIoError, aligned_buffer, chunks


@dataclass
class ReplayResult:
    seconds: float                 # from the first issue to the last completion, both threads
    bytes_read: int
    bytes_written: int
    # What each thread did, in order: ("issue", store, handle, op, path, bytes), ("wait", store, handles),
    # ("recv", pipe, serial), ("send", pipe, serial), each with the time it happened (for the tests).
    log: Dict[str, List[Tuple]] = field(default_factory=dict)
    seconds_by_process: Dict[str, float] = field(default_factory=dict)

    @property
    def bytes_per_s(self) -> float:
        return (self.bytes_read + self.bytes_written) / self.seconds if self.seconds > 0 else float("nan")


class _Messages:
    """The sends each thread has passed, per (pipe, serial), for the other's receives to wait on."""

    def __init__(self, sent_in_record):
        self._condition = threading.Condition()
        self._sent = set()
        self._in_record = set(sent_in_record)
        self.failed = False

    def send(self, pipe: str, serial: int) -> None:
        with self._condition:
            self._sent.add((pipe, serial))
            self._condition.notify_all()

    def receive(self, pipe: str, serial: int) -> None:
        if (pipe, serial) not in self._in_record:
            return  # sent before the record began
        with self._condition:
            while (pipe, serial) not in self._sent and not self.failed:
                self._condition.wait(1.0)
        if self.failed:
            raise RuntimeError("the other replay thread failed")

    def fail(self) -> None:
        with self._condition:
            self.failed = True
            self._condition.notify_all()


class _Stream:
    """One process's events, replayed on handles of its own into one scratch buffer."""

    def __init__(self, process: str, events: List[IoEvent], aio: deepspeed_compat.AioSettings, messages: _Messages):
        self.process, self.events, self.messages = process, events, messages
        keys = sorted({(e.store, e.handles[0]) for e in events if e.kind == "issue"})
        self.handles = {key: deepspeed_compat.new_aio_handle(aio) for key in keys}
        self.in_flight = {key: 0 for key in keys}
        largest = max((e.bytes for e in events if e.kind == "issue"), default=0)
        # Reads and writes may share it: what the replay moves is never looked at.
        locked = deepspeed_compat.new_locked_buffer(next(iter(self.handles.values())), largest) if keys else None
        self._locked = locked is not None
        self.buffer = locked if locked is not None else aligned_buffer(max(largest, 1))
        self.log: List[Tuple] = []
        self.first_issue = self.last_completion = None
        self.error = None

    def close(self) -> None:
        if self._locked:
            deepspeed_compat.free_locked_buffer(next(iter(self.handles.values())), self.buffer)
            self._locked = False

    def run(self) -> None:
        try:
            for event in self.events:
                self._replay(event)
            self._wait(list(self.handles))
        except BaseException as error:  # reported by ``replay``; the other thread must not wait forever
            self.error = error
            self.messages.fail()
            try:
                self._wait(list(self.handles))
            except BaseException:
                pass

    def _replay(self, event: IoEvent) -> None:
        if event.kind == "issue":
            key = (event.store, event.handles[0])
            handle = self.handles[key]
            issue = handle.pread if event.op == "read" else handle.pwrite
            now = time.monotonic()
            self.first_issue = now if self.first_issue is None else self.first_issue
            for offset, length in chunks(event.bytes):
                if issue(self.buffer[offset:offset + length], event.path, False, True, offset) < 0:
                    raise SsdIoError(errno.EIO, f"replay: aio {event.op} of {length} bytes at offset {offset} of "
                                     f"{event.path} could not start")
                self.in_flight[key] += 1
            self.log.append(("issue", event.store, event.handles[0], event.op, event.path, event.bytes, now))
        elif event.kind == "wait":
            self._wait([(event.store, handle) for handle in event.handles])
            self.log.append(("wait", event.store, event.handles, time.monotonic()))
        elif event.kind == "send":
            self.messages.send(event.op, event.serial)
            self.log.append(("send", event.op, event.serial, time.monotonic()))
        elif event.kind == "recv":
            self.messages.receive(event.op, event.serial)
            self.log.append(("recv", event.op, event.serial, time.monotonic()))

    def _wait(self, keys) -> None:
        for key in keys:
            expected = self.in_flight.get(key, 0)
            if not expected:
                continue  # what it waited for was issued before the record began
            completed = self.handles[key].wait()
            self.in_flight[key] = 0
            self.last_completion = time.monotonic()
            if completed != expected:
                raise SsdIoError(errno.EIO, f"replay: aio completed {completed} of {expected} ops on {key}")


def replay(trace: IoTrace, aio: deepspeed_compat.AioSettings) -> ReplayResult:
    """Replay ``trace`` (see the module doc); its files must still exist and hold the regions' sizes."""
    processes = sorted({event.process for event in trace.events})
    messages = _Messages((e.op, e.serial) for e in trace.events if e.kind == "send")
    streams = [_Stream(process, [e for e in trace.events if e.process == process and e.kind != "span"], aio,
                       messages) for process in processes]
    threads = [threading.Thread(target=stream.run, name=f"replay {stream.process}") for stream in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for stream in streams:
        if stream.error is not None:
            raise stream.error
    active = [s for s in streams if s.first_issue is not None]
    seconds = (max(s.last_completion for s in active) - min(s.first_issue for s in active)) if active else 0.0
    moved = trace.bytes_moved()
    for stream in streams:
        stream.close()
    return ReplayResult(seconds, moved["read"], moved["write"], {s.process: s.log for s in streams},
                        {s.process: (s.last_completion - s.first_issue) if s.first_issue is not None else 0.0
                         for s in streams})
