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
            self.events.append(IoEvent("issue", self.process, now, now, store, (handle,), op, path, num_bytes, category))

    def wait(self, store: str, handles: Sequence[str], started: float) -> None:
        if self.enabled:
            self.events.append(IoEvent("wait", self.process, started, time.monotonic(), store, tuple(handles)))

    def message(self, kind: str, pipe: str, serial: int, started: Optional[float] = None) -> None:
        """A ``send`` or ``recv`` of message ``serial`` on ``pipe``; a receive that blocked gives when it began."""
        if self.enabled:
            now = time.monotonic()
            self.events.append(IoEvent(kind, self.process, now if started is None else started, now, op=pipe,
                                       serial=serial))

    def span(self, op: str, started: float, label: str = "") -> None:
        if self.enabled:
            self.events.append(IoEvent("span", self.process, started, time.monotonic(), op=op, label=label))


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


def time_breakdown(trace: IoTrace, start: float, end: float) -> Dict[str, float]:
    """Where the training process's time in [start, end) went: compute (the schedule's forward and
    backward ops, less the waits inside them), waits on the SSD (its stores' waits), waits on the optimizer
    worker (blocking receives of its results), and the rest (Python, copies, the optimizer's bookkeeping)."""
    waits = [e for e in trace.of(TRAIN, "wait")]
    worker_waits = [e for e in trace.of(TRAIN, "recv") if e.op == RESULT_PIPE]
    compute_spans = [e for e in trace.of(TRAIN, "span") if e.op in COMPUTE_OPS]

    def inside_compute(event: IoEvent) -> bool:
        return any(span.start <= event.start and event.end <= span.end for span in compute_spans)

    ssd = sum(e.end - e.start for e in waits)
    worker = sum(e.end - e.start for e in worker_waits)
    compute = sum(e.end - e.start for e in compute_spans) - sum(
        e.end - e.start for e in waits + worker_waits if inside_compute(e))
    total = end - start
    return {"compute": compute, "ssd_wait": ssd, "worker_wait": worker,
            "rest": max(0.0, total - compute - ssd - worker), "total": total}


_PIDS = {TRAIN: 1, WORKER: 2}


def chrome_trace(trace: IoTrace) -> dict:
    """Trace-event JSON (chrome://tracing, Perfetto): per process, one track of schedule ops and waits,
    one per aio handle with each transfer from its issue to the wait that completed it, and the messages
    between the processes as flow arrows."""
    origin = min((event.start for event in trace.events), default=0.0)
    micros = lambda seconds: round((seconds - origin) * 1e6, 3)  # noqa: E731
    events: List[dict] = []
    tracks: Dict[Tuple[str, str], int] = {}

    def track(process: str, name: str) -> int:
        if (process, name) not in tracks:
            tracks[(process, name)] = len(tracks) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": _PIDS[process], "tid": tracks[(process, name)],
                           "args": {"name": name}})
        return tracks[(process, name)]

    for process, pid in _PIDS.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"greedysnake {process}"}})
    sends = {(e.op, e.serial) for e in trace.events if e.kind == "send"}
    receives = {(e.op, e.serial) for e in trace.events if e.kind == "recv"}
    for event in trace.events:
        pid = _PIDS[event.process]
        if event.kind == "span":
            events.append({"ph": "X", "name": event.label or event.op, "cat": "op", "pid": pid, "tid": track(event.process, "schedule"),
                           "ts": micros(event.start), "dur": micros(event.end) - micros(event.start)})
        elif event.kind == "wait":
            events.append({"ph": "X", "name": f"wait {event.store} {','.join(event.handles)}", "cat": "wait", "pid": pid,
                           "tid": track(event.process, "waits"), "ts": micros(event.start),
                           "dur": micros(event.end) - micros(event.start)})
        elif event.kind in ("send", "recv"):
            flow_id = (0 if event.op == TASK_PIPE else 1 << 30) + event.serial
            outgoing = (event.kind == "send")
            events.append({"ph": "X", "name": f"{event.kind} {event.op}#{event.serial}", "cat": "message", "pid": pid,
                           "tid": track(event.process, "messages"), "ts": micros(event.start),
                           "dur": max(0.001, micros(event.end) - micros(event.start))})
            if (event.op, event.serial) not in sends & receives:
                continue  # its other end is outside the record: no arrow
            events.append({"ph": "s" if outgoing else "f", "bp": "e", "name": event.op, "cat": "message", "id": flow_id,
                           "pid": pid, "tid": track(event.process, "messages"),
                           "ts": micros(event.start if outgoing else event.end)})
    # Transfers on one handle overlap (several in flight), so they are async slices, which may.
    for number, (issued, completed) in enumerate(completions(trace)):
        common = {"name": f"{issued.op} {issued.category} {issued.bytes / 2**20:.1f} MiB", "cat": f"aio {issued.store}",
                  "id": number, "pid": _PIDS[issued.process],
                  "tid": track(issued.process, f"aio {issued.store} {issued.handles[0]}")}
        events.append(dict(common, ph="b", ts=micros(issued.start), args={"path": issued.path, "bytes": issued.bytes,
                                                                          "handle": issued.handles[0]}))
        events.append(dict(common, ph="e", ts=micros(completed)))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(trace: IoTrace, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(chrome_trace(trace), handle)
