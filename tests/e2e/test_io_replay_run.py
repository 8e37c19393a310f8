"""A real run's I/O record, both processes: the replay issues exactly what training and the optimizer worker
issued, in their order and with their dependencies, and the Chrome trace of it is valid trace-event JSON."""
import json
import time

import pytest

from ds_greedysnake.storage.io_replay import replay
from ds_greedysnake.storage.io_trace import RESULT_PIPE, TASK_PIPE, TRAIN, WORKER, time_breakdown, write_chrome_trace
from greedysnake_run import make_engine
from helpers import recorded_io

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("overlap", [True, False])
def test_a_traced_step_replays_asrecorded_io(tmp_path, overlap):
    engine, batches = make_engine(str(tmp_path / "nvme"), 3, hidden=128,
                                  greedysnake={"optimizer_overlap": overlap})
    engine.train_batch(batches)
    with pytest.raises(RuntimeError, match="start_io_trace"):
        engine.stop_io_trace()
    engine.start_io_trace()
    with pytest.raises(RuntimeError, match="already on"):
        engine.start_io_trace()
    steps = []
    for _ in range(2):
        started = time.monotonic()
        engine.train_batch(batches)
        steps.append((started, time.monotonic()))
    trace = engine.stop_io_trace()
    engine.close()

    processes = {event.process for event in trace.events}
    assert processes == ({TRAIN, WORKER} if overlap else {TRAIN})
    step = trace.window(steps[1][0], steps[1][1])
    categories = {event.category for event in step.events if event.kind == "issue"}
    assert "param" in categories and step.bytes_moved()["read"] > 0 and step.bytes_moved()["write"] > 0
    parts = time_breakdown(step, *steps[1])
    assert parts["compute"] > 0
    assert parts["compute"] + parts["ssd_wait"] + parts["worker_wait"] + parts["rest"] == pytest.approx(parts["total"])

    result = replay(trace, engine.settings.aio)
    for process in processes:
        assert [entry[:-1] for entry in result.log[process]] == recorded_io(trace, process)
    if overlap:
        assert trace.of(WORKER, "issue"), "the worker's transfers are in the record"
        sent = {(entry[1], entry[2]): entry[-1] for log in result.log.values() for entry in log if entry[0] == "send"}
        received = [(process, entry) for process, log in result.log.items() for entry in log if entry[0] == "recv"]
        assert {entry[1] for _, entry in received} == {TASK_PIPE, RESULT_PIPE}
        for _, entry in received:
            if (entry[1], entry[2]) in sent:
                assert entry[-1] >= sent[(entry[1], entry[2])]
    moved = trace.bytes_moved()
    assert (result.bytes_read, result.bytes_written) == (moved["read"], moved["write"])

    path = tmp_path / "step.json"
    write_chrome_trace(step, str(path))
    document = json.loads(path.read_text())
    phases = {event["ph"] for event in document["traceEvents"]}
    assert {"M", "X", "b", "e"} <= phases
    assert sum(event["ph"] == "b" for event in document["traceEvents"]) == len(
        [e for e in step.events if e.kind == "issue"])
