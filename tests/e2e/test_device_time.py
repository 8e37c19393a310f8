"""While an I/O trace is on off the CPU, the step's compute is timed on the device: timing events recorded on the
compute stream at each compute op's start and end, read once when the trace is stopped, with no host wait
during the steps. Run on the CPU through test_host_waits.py's lagging device double, whose timing events report
a fixed elapsed time once the device has reached them."""
import time

import pytest
import torch

from ds_greedysnake.storage import transfers as transfers_module
from ds_greedysnake.storage.io_trace import COMPUTE_OPS, TRAIN, time_breakdown
from ds_greedysnake.storage.transfers import Transfers
from test_host_waits import LaggingEvent, RecordingDevice, make_engine

pytestmark = pytest.mark.slow

ELAPSED = 0.125  # seconds between any two timing events on the double's device


class TimingEvent(LaggingEvent):
    def record(self, stream):
        # A marker, not work: it does not move the lagging device on (the other events' waits stay as they were).
        self.serial = self._device.serial


class TimingDevice(RecordingDevice):
    """RecordingDevice with timing events and a whole-device synchronize, both counted."""

    def __init__(self):
        super().__init__()
        self.timing_events = 0
        self.synchronizes = 0

    def timing_event(self, stream):
        assert stream is self.compute, "compute is timed on the compute stream"
        self.timing_events += 1
        event = TimingEvent(self)
        event.record(stream)
        return event

    def elapsed_seconds(self, start, end):
        assert start.query() and end.query(), "elapsed time read before the device reached the events"
        return ELAPSED

    def synchronize(self):
        self.synchronizes += 1
        self.ran_to = self.serial


def test_the_traced_steps_compute_is_the_devices_time_and_costs_no_host_wait(tmp_path, monkeypatch):
    device = TimingDevice()
    simulated = Transfers(torch.device("cpu"), device)
    monkeypatch.setattr(Transfers, "for_device", classmethod(lambda cls, _device: simulated))
    monkeypatch.setattr(transfers_module, "_INSTANCES", {})
    engine, batches = make_engine(str(tmp_path), 2, 4)
    try:
        engine.train_batch(batches)  # the first step sizes its buffers
        waits = []
        for traced in (False, True):
            if traced:
                engine.start_io_trace()
                started = time.monotonic()
            before = (device.host_waits, device.event_waits)
            engine.train_batch(batches)
            waits.append((device.host_waits - before[0], device.event_waits - before[1]))
        ended = time.monotonic()
        assert device.synchronizes == 0, "the host waited for the device while recording"
        trace = engine.stop_io_trace()
    finally:
        engine.close()
    assert waits[1] == waits[0], f"recording the device's time added host waits: {waits}"
    assert device.synchronizes == 1  # once, when the trace was read
    spans = [event for event in trace.of(TRAIN, "span") if event.op in COMPUTE_OPS]
    assert spans and device.timing_events == 2 * len(spans)
    assert {span.device_seconds for span in spans} == {ELAPSED}
    assert all(span.device_seconds is None for span in trace.of(TRAIN, "span") if span.op not in COMPUTE_OPS)
    parts = time_breakdown(trace, started, ended)
    assert parts["compute_clock"] == "device"
    assert parts["compute"] == pytest.approx(ELAPSED * len(spans))
