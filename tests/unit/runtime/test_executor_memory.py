"""What the executor keeps across micro-batches does not grow with their number."""
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ds_greedysnake.deepspeed_compat import AioSettings
from ds_greedysnake.runtime.activations import ActivationStore
from ds_greedysnake.runtime.executor import Executor
from ds_greedysnake.storage.ssd import IoCounters, SsdStore
from ds_greedysnake.storage.transfers import Transfers

CPU = torch.device("cpu")


class StubLayer:
    """A resident layer: the executor's evaluate only fetches, runs and releases it."""

    def __init__(self, index, module):
        self.index, self.module, self.device = index, module, CPU
        self.trainable = True
        self.transfers = Transfers(CPU)

    def fetch(self):
        pass

    def prefetch(self):
        pass

    def release(self):
        pass

    def discard_grads(self):
        pass


@pytest.mark.parametrize("num_micro_batches", [2, 6])
def test_evaluate_holds_one_micro_batch_of_logits(num_micro_batches):
    torch.manual_seed(0)
    modules = [nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 32)]
    layers = [StubLayer(index, module) for index, module in enumerate(modules)]
    logits, peak = [], [0]

    def loss_fn(output, labels):
        logits.append(weakref.ref(output))
        peak[0] = max(peak[0], sum(reference() is not None for reference in logits))
        return nn.functional.cross_entropy(output.reshape(-1, 32), labels.reshape(-1))

    optimizer = SimpleNamespace(needs_every_gradient_first=False)
    executor = Executor(layers, ActivationStore(None, 1 << 30, CPU), optimizer, loss_fn, torch.float32,
                        prefetch=True, overlap=False, deferred_layers=None)
    batches = [(torch.randint(0, 16, (2, 4)), torch.randint(0, 32, (2, 4))) for _ in range(num_micro_batches)]
    losses, metrics = executor.evaluate(batches)
    assert metrics == [{}] * num_micro_batches
    assert peak[0] == 1  # each micro-batch's logits go into its loss, then away
    with torch.no_grad():
        expected = [float(loss_fn(modules[2](modules[1](modules[0](inputs))), labels)) for inputs, labels in batches]
    assert losses == expected


def test_evaluate_reads_the_next_layer_while_this_one_computes():
    """Each layer's prefetch is started before its predecessor's first micro-batch runs (issue 30, item 8):
    without it, evaluate read every layer only at its fetch, the compute idle meanwhile."""
    torch.manual_seed(0)
    modules = [nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 32)]
    events = []

    class RecordingLayer(StubLayer):
        def prefetch(self):
            events.append(("prefetch", self.index))

        def fetch(self):
            events.append(("fetch", self.index))

    layers = [RecordingLayer(index, module) for index, module in enumerate(modules)]
    for layer in layers:
        layer.module.register_forward_pre_hook(lambda module, args, index=layer.index: events.append(("run", index)))
    optimizer = SimpleNamespace(needs_every_gradient_first=False)
    executor = Executor(layers, ActivationStore(None, 1 << 30, CPU), optimizer,
                        lambda output, labels: output.float().mean(), torch.float32,
                        prefetch=True, overlap=False, deferred_layers=None)
    executor.evaluate([(torch.randint(0, 16, (2, 4)), None) for _ in range(3)])
    for index in range(len(layers) - 1):
        assert events.index(("prefetch", index + 1)) < events.index(("run", index)), events


def test_evaluate_with_every_checkpoint_spilled_hands_its_read_order_to_the_store(tmp_path):
    """Evaluation announces the order it reads checkpoints in (layer by layer, micro-batches ascending), and
    reads them in it; every checkpoint spilled, the losses are the same."""
    torch.manual_seed(0)
    modules = [nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 32)]
    layers = [StubLayer(index, module) for index, module in enumerate(modules)]

    def loss_fn(output, labels):
        return nn.functional.cross_entropy(output.reshape(-1, 32), labels.reshape(-1))

    counters = IoCounters()
    store = SsdStore(str(tmp_path), AioSettings(), counters, "act")
    optimizer = SimpleNamespace(needs_every_gradient_first=False)
    activations = ActivationStore(store, 0, CPU, staging_buffers=2)
    announced, read = [], []
    expect_reads, take = activations.expect_reads, activations.take
    activations.expect_reads = lambda order: announced.append(list(order)) or expect_reads(order)
    activations.take = lambda *key: read.append(key) or take(*key)
    executor = Executor(layers, activations, optimizer, loss_fn, torch.float32,
                        prefetch=True, overlap=False, deferred_layers=None)
    batches = [(torch.randint(0, 16, (2, 4)), torch.randint(0, 32, (2, 4))) for _ in range(5)]
    losses, _ = executor.evaluate(batches)
    with torch.no_grad():
        expected = [float(loss_fn(modules[3](modules[2](modules[1](modules[0](inputs)))), labels))
                    for inputs, labels in batches]
    assert losses == expected
    assert announced == [read]
    assert counters.writes["activation"] == 3 * 5  # layers 1, 2 and 3, every micro-batch
    assert counters.reads["activation"] > 0
    assert not store._in_flight
    store.close()
