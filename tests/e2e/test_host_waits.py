"""How often the host waits on the device in one step: the engine's step run on the CPU through a recording
double of the accelerator's streams. Reads of device values (losses, gradient norms) are two per step and
waits on copy events one (the decision's, for the last gradient handed over), whatever the number of layers
and micro-batches: updates are submitted once their gradient's copy is seen done (``LayerwiseAdam.poll``),
the parameter pool has a spare buffer off the CPU, gradients through SSD have two staging buffers there,
and four copies to the host may be in flight; with the gradients in host slots and through SSD.
With every checkpoint spilled too (and the gradients and states through SSD) the count is the same, (2, 1):
a spill's SSD write starts from the executor's poll once its copy is seen done, reads are started ahead
into staging buffers no device copy still uses, and a copy back to the device from a staging buffer is
ordered on the device, never on the host (spill.py; a ring too small, or the blocking copy and synchronous
write and read before it, gave 9, 103, 17 and 191 event waits for L = 4, M = 1 / 8 and L = 8, M = 1 / 8).

The double copies at once (so the results are the real ones) but models a device that runs behind the host:
an event completes once ``LAG`` later events have been recorded after it (the host has queued that much
more work), and a device runs its work in order: once the host has waited for an event, or read device
values, everything recorded before has completed too. A host wait on an event that has not completed
(``Guard.wait``) is counted, and so is every read of device values (``Transfers.read_values``). Reverting
any one of these changes makes the waits grow with L or M (5 and 9, or 6 and 10 through SSD, at L = 4
and 8). The step itself must still give the weights of the plain CPU path, bitwise."""
import contextlib
import os

import pytest
import torch

from ds_greedysnake.storage import transfers as transfers_module
from ds_greedysnake.storage.transfers import Transfers
import ds_greedysnake
from ds_greedysnake.models.gpt import GPTConfig, lm_loss
from helpers import data, ds_config, fresh_model


def make_engine(nvme_path, num_micro_batches, num_layers, greedysnake=None):
    os.makedirs(nvme_path, exist_ok=True)
    config = GPTConfig(vocab_size=256, seq_len=16, hidden=128, num_heads=4, num_layers=num_layers)
    engine, _, _, _ = ds_greedysnake.initialize(
        model=fresh_model(config), config=ds_config(nvme_path, num_micro_batches, greedysnake=greedysnake),
        loss_fn=lm_loss)
    return engine, data(config)

pytestmark = pytest.mark.slow

LAG = 4  # events the device runs behind the host


class LaggingEvent:
    def __init__(self, device):
        self._device = device
        self.serial = None
        self.completed = False

    def record(self, stream):
        self.serial = self._device.next_serial()

    def query(self):
        if not self.completed and (self._device.serial - self.serial >= LAG or self.serial <= self._device.ran_to):
            self.completed = True
        return self.completed

    def synchronize(self):
        if not self.query():
            self._device.event_waits += 1
            self._device.ran_to = max(self._device.ran_to, self.serial)  # a device runs its work in order
            self.completed = True


class LaggingStream:
    def wait_event(self, event):
        pass


class RecordingDevice:
    """AcceleratorStreams' interface over the CPU, counting the host's waits."""

    def __init__(self):
        self.serial = 0
        self.ran_to = 0       # every event up to this one has completed (the host waited for it)
        self.host_waits = 0   # reads of device values
        self.event_waits = 0  # waits on an event the lagging device has not reached
        self.inbound, self.outbound, self.compute = LaggingStream(), LaggingStream(), LaggingStream()

    def next_serial(self):
        self.serial += 1
        return self.serial

    def current(self):
        return self.compute

    def on(self, stream):
        return contextlib.nullcontext()

    def record(self, stream):
        event = LaggingEvent(self)
        event.record(stream)
        return event

    def keep_for(self, tensor, stream):
        pass

    def read_values(self, tensor):
        self.host_waits += 1
        self.ran_to = self.serial  # the read waited for everything queued so far
        return tensor.tolist()


def _waits_in_one_step(tmp_path, monkeypatch, num_layers, num_micro_batches, greedysnake=None):
    device = RecordingDevice()
    simulated = Transfers(torch.device("cpu"), device)
    monkeypatch.setattr(Transfers, "for_device", classmethod(lambda cls, _device: simulated))
    monkeypatch.setattr(transfers_module, "_INSTANCES", {})
    engine, batches = make_engine(str(tmp_path / f"l{num_layers}_m{num_micro_batches}"), num_micro_batches, num_layers,
                                  greedysnake)
    try:
        engine.train_batch(batches)  # the first step sizes its buffers
        reads, waits = device.host_waits, device.event_waits
        engine.train_batch(batches)
        return (device.host_waits - reads, device.event_waits - waits), engine.master_parameters()
    finally:
        engine.close()


PLACEMENTS = [None, {"gradient_host_memory_mb": 0, "optimizer_host_memory_mb": 0},
              {"activation_host_memory_mb": 0, "gradient_host_memory_mb": 0, "optimizer_host_memory_mb": 0}]
PLACEMENT_IDS = ["host slots", "gradients and states through SSD", "everything through SSD"]


@pytest.mark.parametrize("greedysnake", PLACEMENTS, ids=PLACEMENT_IDS)
def test_host_waits_per_step_do_not_grow_with_layers_or_micro_batches(tmp_path, monkeypatch, greedysnake):
    counts = {(layers, micro): _waits_in_one_step(tmp_path, monkeypatch, layers, micro, greedysnake)[0]
              for layers in (4, 8) for micro in (1, 8)}
    # Every micro-batch's loss in one read, every layer's norm in one; one wait, for the last gradient's copy.
    # Spilled checkpoints add none: their copies are polled, never waited for (module docstring).
    assert set(counts.values()) == {(2, 1)}, counts


@pytest.mark.parametrize("greedysnake", PLACEMENTS, ids=PLACEMENT_IDS)
def test_the_simulated_device_path_gives_the_cpu_path_weights(tmp_path, monkeypatch, greedysnake):
    _, simulated = _waits_in_one_step(tmp_path, monkeypatch, 4, 2, greedysnake)
    monkeypatch.undo()
    engine, batches = make_engine(str(tmp_path / "plain"), 2, 4, greedysnake)
    try:
        for _ in range(2):
            engine.train_batch(batches)
        plain = engine.master_parameters()
    finally:
        engine.close()
    for name, value in plain.items():
        assert torch.equal(simulated[name], value), name
