"""The I/O record (io_trace.py), its replay (io_replay.py), the time breakdown and the Chrome trace."""
import json

import pytest

from ds_greedysnake.deepspeed_compat import AioSettings
from ds_greedysnake.storage.io_replay import replay
from ds_greedysnake.storage.io_trace import (RESULT_PIPE, TASK_PIPE, TRAIN, WORKER, IoEvent, IoRecorder, IoTrace,
                                             chrome_trace, completions, time_breakdown)
from ds_greedysnake.storage.ssd import IoCounters, SsdStore, padded_size
from helpers import recorded_io


def _written(store, label, num_bytes):
    region = store.create_region(label, num_bytes, "param")
    buffer = store.new_buffer(region)
    store.write(region, buffer)
    return region, buffer


def test_a_store_records_each_transfer_on_its_handle_and_each_wait(tmp_path):
    recorder = IoRecorder(TRAIN)
    store = SsdStore(str(tmp_path), AioSettings(), IoCounters(), "param", read_handles=2, recorder=recorder)
    (first, a), (second, b) = _written(store, "a", 8192), _written(store, "b", 3 << 20)
    third = store.create_region("c", 8192, "grad")
    recorder.start()
    store.start_read(first, a)
    store.start_read(second, b)
    store.start_write(third, store.new_buffer(third))
    store.wait_for_read(b)
    store.wait()
    events = recorder.stop()
    issues = [(e.store, e.handles, e.op, e.path, e.bytes) for e in events if e.kind == "issue"]
    assert issues == [("param", ("r0",), "read", first.path, first.padded_bytes),
                      ("param", ("r1",), "read", second.path, second.padded_bytes),
                      ("param", ("w",), "write", third.path, third.padded_bytes)]
    waits = [sorted(e.handles) for e in events if e.kind == "wait"]
    assert waits == [["r1"], ["r0", "w"]]
    assert all(e.start <= e.end for e in events)
    # Off again: nothing more is recorded.
    store.read(first, a)
    assert recorder.events == []


def _two_process_trace(tmp_path):
    """Training reads a region and asks the worker for an update; the worker reads and writes another
    region, answers, and training reads the written region: what the replay must keep in order."""
    recorders = {process: IoRecorder(process) for process in (TRAIN, WORKER)}
    stores = {process: SsdStore(str(tmp_path / process), AioSettings(), IoCounters(), process,
                                recorder=recorders[process])
              for process in (TRAIN, WORKER)}
    param, param_buffer = _written(stores[TRAIN], "param", 64 << 10)
    state, state_buffer = _written(stores[WORKER], "state", 5 << 20)
    for recorder in recorders.values():
        recorder.start()
    train, worker = stores[TRAIN], stores[WORKER]
    train.start_read(param, param_buffer)
    recorders[TRAIN].message("send", TASK_PIPE, 7)
    recorders[WORKER].message("recv", TASK_PIPE, 7)
    worker.read(state, state_buffer)
    worker.write(state, state_buffer)
    recorders[WORKER].message("send", RESULT_PIPE, 3)
    recorders[TRAIN].message("recv", RESULT_PIPE, 2)  # sent before the record: holds nothing up
    recorders[TRAIN].message("recv", RESULT_PIPE, 3)
    train.wait()
    train.read(param, param_buffer)
    return IoTrace(recorders[TRAIN].stop() + recorders[WORKER].stop())


def test_the_replay_issues_the_recorded_operations_in_order_and_keeps_the_messages_order(tmp_path):
    trace = _two_process_trace(tmp_path)
    result = replay(trace, AioSettings())
    for process in (TRAIN, WORKER):
        assert [entry[:-1] for entry in result.log[process]] == recorded_io(trace, process)
    times = {(process, entry[0], entry[1], entry[2]): entry[-1] for process, log in result.log.items()
             for entry in log if entry[0] in ("send", "recv")}
    assert times[(WORKER, "recv", TASK_PIPE, 7)] >= times[(TRAIN, "send", TASK_PIPE, 7)]
    assert times[(TRAIN, "recv", RESULT_PIPE, 3)] >= times[(WORKER, "send", RESULT_PIPE, 3)]
    # The worker's write is issued only after training asked for it.
    worker_write = next(entry[-1] for entry in result.log[WORKER] if entry[0] == "issue" and entry[3] == "write")
    assert worker_write >= times[(TRAIN, "send", TASK_PIPE, 7)]
    moved = trace.bytes_moved()
    assert (result.bytes_read, result.bytes_written) == (moved["read"], moved["write"])
    assert moved == {"read": 2 * padded_size(64 << 10) + padded_size(5 << 20), "write": padded_size(5 << 20)}
    assert 0 < result.seconds and result.bytes_per_s > 0


def test_the_replay_round_trips_through_json(tmp_path):
    trace = _two_process_trace(tmp_path)
    again = IoTrace.from_json(json.loads(json.dumps(trace.to_json())))
    assert again.events == trace.events
    assert [entry[:-1] for entry in replay(again, AioSettings()).log[WORKER]] == recorded_io(trace, WORKER)


def test_a_failed_transfer_in_one_thread_does_not_hang_the_other(tmp_path):
    trace = _two_process_trace(tmp_path)
    missing = [e for e in trace.events if not (e.process == TRAIN and e.kind == "issue")]
    first_issue = next(e for e in trace.events if e.process == WORKER and e.kind == "issue")
    broken = IoEvent(**{**first_issue.__dict__, "path": str(tmp_path / "gone.bin")})
    events = [broken if e is first_issue else e for e in missing]
    with pytest.raises(Exception):
        replay(IoTrace(events), AioSettings())


def _event(kind, process, start, end, **fields):
    return IoEvent(kind, process, start, end, **fields)


def test_time_breakdown_separates_compute_from_the_waits_inside_it():
    trace = IoTrace([
        _event("span", TRAIN, 0.0, 1.0, op="fetch"),
        _event("wait", TRAIN, 0.2, 0.9, store="param", handles=("r0",)),
        _event("span", TRAIN, 1.0, 3.0, op="forward"),
        _event("wait", TRAIN, 1.5, 2.0, store="activation", handles=("r0",)),
        _event("span", TRAIN, 3.0, 4.0, op="update"),
        _event("recv", TRAIN, 3.1, 3.6, op=RESULT_PIPE, serial=1),
        _event("recv", TRAIN, 3.7, 3.7, op=TASK_PIPE, serial=1),  # not a wait on the worker
    ])
    parts = time_breakdown(trace, 0.0, 5.0)
    assert parts["compute"] == pytest.approx(1.5)
    assert parts["ssd_wait"] == pytest.approx(1.2)
    assert parts["worker_wait"] == pytest.approx(0.5)
    assert parts["rest"] == pytest.approx(1.8)
    assert parts["total"] == 5.0
    assert parts["compute_clock"] == "host"


def test_time_breakdown_takes_the_devices_compute_time_where_the_spans_have_it():
    """Off the CPU each compute span carries the device's time of its compute-stream work: that is the compute
    (the host's waits inside the span overlap it and are not taken off), and the breakdown names the clock;
    the device time survives the trace's JSON."""
    events = [
        _event("span", TRAIN, 0.0, 1.0, op="fetch"),
        _event("wait", TRAIN, 0.2, 0.9, store="param", handles=("r0",)),
        _event("span", TRAIN, 1.0, 3.0, op="forward", device_seconds=0.25),
        _event("wait", TRAIN, 1.5, 2.0, store="activation", handles=("r0",)),
        _event("span", TRAIN, 3.0, 3.5, op="backward", device_seconds=1.5),
    ]
    parts = time_breakdown(IoTrace.from_json(IoTrace(events).to_json()), 0.0, 5.0)
    assert parts["compute_clock"] == "device"
    assert parts["compute"] == pytest.approx(1.75)
    assert parts["ssd_wait"] == pytest.approx(1.2)
    assert parts["rest"] == pytest.approx(2.05)
    host_timed = [IoEvent(**dict(vars(event), device_seconds=None)) for event in events]
    parts = time_breakdown(IoTrace(host_timed), 0.0, 5.0)
    assert parts["compute_clock"] == "host" and parts["compute"] == pytest.approx(2.5 - 0.5)
    assert time_breakdown(IoTrace(events[:3] + host_timed[3:]), 0.0, 5.0)["compute_clock"] == "mixed"


def test_each_transfer_completes_at_the_first_wait_on_its_handle():
    issue_a = _event("issue", TRAIN, 0.0, 0.0, store="s", handles=("r0",), op="read", bytes=4096)
    issue_b = _event("issue", TRAIN, 0.1, 0.1, store="s", handles=("w",), op="write", bytes=4096)
    trace = IoTrace([issue_a, issue_b, _event("wait", TRAIN, 0.2, 0.5, store="s", handles=("r0",)),
                     _event("wait", TRAIN, 0.6, 0.8, store="t", handles=("w",)),  # another store's handle
                     _event("span", TRAIN, 0.8, 1.0, op="forward")])
    assert completions(trace) == [(issue_a, 0.5), (issue_b, 1.0)]


def test_the_chrome_trace_is_valid_trace_event_json(tmp_path):
    trace = _two_process_trace(tmp_path)
    trace.events.append(_event("span", TRAIN, trace.events[0].start, trace.events[-1].end, op="forward",
                               label="forward[0,0]"))
    document = json.loads(json.dumps(chrome_trace(trace)))
    events = document["traceEvents"]
    assert document["displayTimeUnit"] == "ms"
    for event in events:
        assert event["ph"] in {"M", "X", "b", "e", "s", "f"}
        assert isinstance(event["pid"], int) and isinstance(event["name"], str)
        if event["ph"] != "M":
            assert isinstance(event["tid"], int) and event["ts"] >= 0
        if event["ph"] == "X":
            assert event["dur"] >= 0
    begins = {(e["cat"], e["id"]): e for e in events if e["ph"] == "b"}
    ends = {(e["cat"], e["id"]): e for e in events if e["ph"] == "e"}
    assert begins.keys() == ends.keys() and len(begins) == len(trace.of(TRAIN, "issue") + trace.of(WORKER, "issue"))
    assert all(ends[key]["ts"] >= begins[key]["ts"] for key in begins)
    flows = {}
    for e in events:
        if e["ph"] in "sf":
            flows.setdefault(e["id"], []).append(e["ph"])
    # Messages with both ends in the record are arrows; the one sent before it is none.
    assert sorted(map(sorted, flows.values())) == [["f", "s"], ["f", "s"]]
    assert any(e["name"] == "forward[0,0]" for e in events)
