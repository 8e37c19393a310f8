"""A record of training's SSD operations in both processes, where a step's time went, and a Chrome trace.

While a trace is on (``engine.start_io_trace()`` .. ``engine.stop_io_trace()``), every ``SsdStore`` of
the training process and of the optimizer worker appends to an ``IoRecorder``:

* ``issue``: one transfer (a region, whole) submitted to one of the store's aio handles;
* ``wait``: the store waited on some of its handles (everything in flight there completes);
* ``send`` / ``recv``: a message on one of the pipes between the processes, numbered in pipe order
  (both ends count every message from the worker's start, so the numbers match across processes), and
  for a blocking receive how long it blocked;
* ``span``: one op of the step's schedule (training process only), for where the time went.

Times are ``time.monotonic()``, one clock for both processes (Linux's CLOCK_MONOTONIC). The replay of
such a record with no compute (``io_replay.py``) is the step's I/O floor.
"""
import bisect
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

TRAIN, WORKER = "train", "worker"  # the two processes
TASK_PIPE, RESULT_PIPE = "tasks", "results"  # training -> worker, worker -> training
COMPUTE_OPS = ("forward", "backward", "loss_backward")


@dataclass
class IoEvent:
    kind: str            # "issue", "wait", "send", "recv" or "span"
    process: str         # TRAIN or WORKER
    start: float         # time.monotonic() seconds
    end: float           # the same as ``start`` for an issue and a send
    store: str = ""      # issue, wait: the SsdStore's name
    handles: Tuple[str, ...] = ()  # issue: the one handle ("r0", "r1", ... reads, "w" writes); wait: those waited
    op: str = ""         # issue: "read" or "write"; send, recv: the pipe; span: the schedule op
    path: str = ""       # issue: the region's file
    bytes: int = 0       # issue: the region's padded bytes
    category: str = ""   # issue: the region's IoCounters category
    serial: int = 0      # send, recv: the message's number on its pipe
    label: str = ""      # span: the op with its layer and micro-batch
    # span of a compute op, off the CPU: the device's time between timing events recorded on the compute
    # stream at the op's start and end (the host only queues the kernels); None where the device is the host
    device_seconds: Optional[float] = None


class IoRecorder:
    """Events of one process while ``enabled``; cheap to call when it is not."""

    def __init__(self, process: str):
        self.process = process
        self.enabled = False
        self.events: List[IoEvent] = []

    def start(self) -> None:
        self.events, self.enabled = [], True

    def stop(self) -> List[IoEvent]:
        self.enabled = False
        events, self.events = self.events, []
        return events

    def issue(self, store: str, handle: str, op: str, path: str, num_bytes: int, category: str) -> None:
        if self.enabled:
            now = time.monotonic()
            self.events.append(IoEvent("issue", self.process, now, now, store, (handle,), op, path, num_bytes,
                                       category))

    def wait(self, store: str, handles: Sequence[str], started: float) -> None:
        if self.enabled:
            self.events.append(IoEvent("wait", self.process, started, time.monotonic(), store, tuple(handles)))

    def message(self, kind: str, pipe: str, serial: int, started: Optional[float] = None) -> None:
        """A ``send`` or ``recv`` of message ``serial`` on ``pipe``; a receive that blocked gives when it began."""
        if self.enabled:
            now = time.monotonic()
            self.events.append(IoEvent(kind, self.process, now if started is None else started, now, op=pipe,
                                       serial=serial))

    def span(self, op: str, started: float, label: str = "") -> Optional[IoEvent]:
        """The op's span (its ``device_seconds`` may be filled in later), None while not enabled."""
        if self.enabled:
            self.events.append(IoEvent("span", self.process, started, time.monotonic(), op=op, label=label))
            return self.events[-1]
        return None


@dataclass
class IoTrace:
    """Both processes' events, each process's in program order."""
    events: List[IoEvent] = field(default_factory=list)

    def window(self, start: float, end: float) -> "IoTrace":
        """The events that began in [start, end): one step, when given its start and the next one's."""
        return IoTrace([event for event in self.events if start <= event.start < end])

    def of(self, process: str, kind: Optional[str] = None) -> List[IoEvent]:
        return [e for e in self.events if e.process == process and (kind is None or e.kind == kind)]

    def bytes_moved(self) -> Dict[str, int]:
        moved = {"read": 0, "write": 0}
        for event in self.events:
            if event.kind == "issue":
                moved[event.op] += event.bytes
        return moved

    def to_json(self) -> dict:
        return {"events": [asdict(event) for event in self.events]}

    @classmethod
    def from_json(cls, data: dict) -> "IoTrace":
        return cls([IoEvent(**dict(event, handles=tuple(event["handles"]))) for event in data["events"]])


def completions(trace: IoTrace) -> List[Tuple[IoEvent, float]]:
    """Each issue with the time it was known complete: the end of the first later wait of its process and
    store on its handle (the end of the trace where none came)."""
    last = max((event.end for event in trace.events), default=0.0)
    pending: Dict[Tuple[str, str, str], List[IoEvent]] = {}
    done = []
    for event in trace.events:
        if event.kind == "issue":
            pending.setdefault((event.process, event.store, event.handles[0]), []).append(event)
        elif event.kind == "wait":
            for handle in event.handles:
                for issued in pending.pop((event.process, event.store, handle), []):
                    done.append((issued, event.end))
    done += [(issued, last) for issued_list in pending.values() for issued in issued_list]
    return sorted(done, key=lambda pair: pair[0].start)


def time_breakdown(trace: IoTrace, start: float, end: float) -> Dict[str, object]:
    """Where the training process's time in [start, end) went: compute (the schedule's forward and
    backward ops, less the waits inside them), waits on the SSD (its stores' waits), waits on the optimizer
    worker (blocking receives of its results), and the rest (Python, copies, the optimizer's bookkeeping).

    Off the CPU the host only queues a compute op's kernels: where its span has ``device_seconds``, those
    count as its compute (the device's time between the op's start and end on the compute stream, waits
    of that stream for copies and gathers included) and the host's waits inside it are not taken off (they
    overlap the device's work; the parts may then add up to more than the total, and the rest is 0).
    ``compute_clock`` says which clock the compute figure came from: "host" (the CPU accelerator:
    unchanged), "device", or "mixed" (some spans without device time, which a run does not produce)."""
    waits = [e for e in trace.of(TRAIN, "wait")]
    worker_waits = [e for e in trace.of(TRAIN, "recv") if e.op == RESULT_PIPE]
    compute_spans = sorted((e for e in trace.of(TRAIN, "span") if e.op in COMPUTE_OPS), key=lambda e: e.start)
    starts = [span.start for span in compute_spans]

    def holding_span(event: IoEvent) -> Optional[IoEvent]:
        """The compute span the event lies in, if any."""
        # One thread: spans do not overlap, so only the last one starting before the event can hold it.
        index = bisect.bisect_right(starts, event.start) - 1
        return compute_spans[index] if index >= 0 and event.end <= compute_spans[index].end else None

    def host_timed_compute_holds(event: IoEvent) -> bool:
        span = holding_span(event)
        return span is not None and span.device_seconds is None

    ssd = sum(e.end - e.start for e in waits)
    worker = sum(e.end - e.start for e in worker_waits)
    compute = sum(e.end - e.start if e.device_seconds is None else e.device_seconds for e in compute_spans) - sum(
        e.end - e.start for e in waits + worker_waits if host_timed_compute_holds(e))
    clocks = {"host" if span.device_seconds is None else "device" for span in compute_spans}
    total = end - start
    return {"compute": compute, "ssd_wait": ssd, "worker_wait": worker,
            "rest": max(0.0, total - compute - ssd - worker), "total": total,
            "compute_clock": clocks.pop() if len(clocks) == 1 else ("host" if not clocks else "mixed")}


_PIDS = {TRAIN: 1, WORKER: 2}


class _ChromeTrace:
    """Trace events built up track by track (a track: one named row of one process)."""

    def __init__(self, origin: float):
        self.origin = origin
        self.events: List[dict] = [{"ph": "M", "name": "process_name", "pid": pid,
                                    "args": {"name": f"greedysnake {process}"}} for process, pid in _PIDS.items()]
        self._tracks: Dict[Tuple[str, str], int] = {}

    def micros(self, seconds: float) -> float:
        return round((seconds - self.origin) * 1e6, 3)

    def track(self, process: str, name: str) -> int:
        if (process, name) not in self._tracks:
            self._tracks[(process, name)] = len(self._tracks) + 1
            self.events.append({"ph": "M", "name": "thread_name", "pid": _PIDS[process],
                                "tid": self._tracks[(process, name)], "args": {"name": name}})
        return self._tracks[(process, name)]

    def complete(self, event: IoEvent, name: str, category: str, track_name: str) -> None:
        """A slice from the event's start to its end."""
        self.events.append({"ph": "X", "name": name, "cat": category, "pid": _PIDS[event.process],
                            "tid": self.track(event.process, track_name), "ts": self.micros(event.start),
                            "dur": max(0.001, self.micros(event.end) - self.micros(event.start))})

    def arrow_end(self, event: IoEvent) -> None:
        """One end of a message's arrow: its send, or its receive's completion."""
        outgoing = event.kind == "send"
        self.events.append({"ph": "s" if outgoing else "f", "bp": "e", "name": event.op, "cat": "message",
                            "id": (0 if event.op == TASK_PIPE else 1 << 30) + event.serial,
                            "pid": _PIDS[event.process], "tid": self.track(event.process, "messages"),
                            "ts": self.micros(event.start if outgoing else event.end)})

    def transfer(self, number: int, issued: IoEvent, completed: float) -> None:
        """An async slice: transfers on one handle overlap (several in flight), which plain slices may not."""
        common = {"name": f"{issued.op} {issued.category} {issued.bytes / 2**20:.1f} MiB", "id": number,
                  "cat": f"aio {issued.store}", "pid": _PIDS[issued.process],
                  "tid": self.track(issued.process, f"aio {issued.store} {issued.handles[0]}")}
        self.events.append(dict(common, ph="b", ts=self.micros(issued.start),
                                args={"path": issued.path, "bytes": issued.bytes, "handle": issued.handles[0]}))
        self.events.append(dict(common, ph="e", ts=self.micros(completed)))


def chrome_trace(trace: IoTrace) -> dict:
    """Trace-event JSON (chrome://tracing, Perfetto): per process, one track of schedule ops, one of waits,
    one of messages, one per aio handle with each transfer from its issue to the wait that completed it,
    and each message with both ends in the record as an arrow."""
    out = _ChromeTrace(min((event.start for event in trace.events), default=0.0))
    ends = {kind: {(e.op, e.serial) for e in trace.events if e.kind == kind} for kind in ("send", "recv")}
    for event in trace.events:
        if event.kind == "span":
            out.complete(event, event.label or event.op, "op", "schedule")
        elif event.kind == "wait":
            out.complete(event, f"wait {event.store} {','.join(event.handles)}", "wait", "waits")
        elif event.kind in ("send", "recv"):
            out.complete(event, f"{event.kind} {event.op}#{event.serial}", "message", "messages")
            if (event.op, event.serial) in ends["send"] & ends["recv"]:
                out.arrow_end(event)
    for number, (issued, completed) in enumerate(completions(trace)):
        out.transfer(number, issued, completed)
    return {"traceEvents": out.events, "displayTimeUnit": "ms"}


def write_chrome_trace(trace: IoTrace, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(chrome_trace(trace), handle)
