"""One-slot layers: a region rewritten in place and a second region over the same file still fail loudly on a
lost write or on reading what the other wrote; updates in place and weight recasts give the two-slot bits."""
import copy
import os

import pytest
import torch

from ds_greedysnake.deepspeed_compat import AdamHyperparameters, AioSettings, CpuAdamKernel
from ds_greedysnake.storage.host_memory import HostArena, SharedHostMemory
from ds_greedysnake.storage.ssd import IoCounters, SsdIoError, SsdStore, padded_size
from ds_greedysnake.optim.update_pipeline import UpdateBuffers, UpdatePipeline
from ds_greedysnake.optim.updates import UpdateTask, plan_write

HYPER = AdamHyperparameters(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01)
NUMEL = 3000


@pytest.fixture
def store(tmp_path):
    return SsdStore(str(tmp_path), AioSettings(), IoCounters(), "t")


def filled(store, num_bytes, value):
    buffer = store.buffer(padded_size(num_bytes))
    buffer.fill_(value)
    return buffer


def test_a_lost_in_place_write_is_caught(store):
    region = store.create_region("weights", 10_000, "param")
    store.write(region, filled(store, 10_000, 1))
    with open(region.path, "rb") as handle:
        before = handle.read()
    store.write(region, filled(store, 10_000, 2))  # in place: the same file, the next generation
    with open(region.path, "r+b") as handle:
        handle.write(before)  # as if the second write never reached the disk
    with pytest.raises(SsdIoError, match="not what was last written"):
        store.read(region, store.buffer(region.padded_bytes))


def test_two_regions_over_one_file_catch_a_read_of_the_other(store):
    weights = store.create_region("weights", 2 * NUMEL, "param", file_bytes=padded_size(4 * NUMEL))
    gradient = store.alias_region(weights, 4 * NUMEL, "grad")
    assert os.path.getsize(weights.path) == padded_size(4 * NUMEL) and gradient.path == weights.path
    target = store.buffer(padded_size(4 * NUMEL))
    store.write(weights, filled(store, 2 * NUMEL, 1))
    store.read(weights, target)
    with pytest.raises(SsdIoError, match="not what was last written"):
        store.read(gradient, target)  # the gradient was never written: stale bytes are refused
    store.write(gradient, filled(store, 4 * NUMEL, 3))
    store.read(gradient, target)
    assert int(target[:4 * NUMEL].min()) == 3
    with pytest.raises(SsdIoError, match="not what was last written"):
        store.read(weights, target)  # the gradient overwrote the weights: reading them must fail


class Layer:
    """One layer's states on SSD (one or two slots, one piece), weights in the compute dtype, an SSD gradient."""

    def __init__(self, folder, slots, grad_dtype=torch.float32):
        self.store = SsdStore(str(folder), AioSettings(), IoCounters(), "t")
        self.host = SharedHostMemory(HostArena.for_gradients([NUMEL], 0), HostArena.for_optimizer_states([NUMEL], 0, 0))
        self.states = [self.store.create_region(f"opt_s{slot}", 12 * NUMEL, "optimizer") for slot in range(slots)]
        self.params = self.store.create_region("param", 2 * NUMEL, "param", file_bytes=padded_size(4 * NUMEL))
        element = torch.empty(0, dtype=grad_dtype).element_size()
        self.grad = self.store.alias_region(self.params, element * NUMEL, "grad")
        self.grad_dtype = grad_dtype
        generator = torch.Generator().manual_seed(0)
        staging = self.store.buffer(padded_size(12 * NUMEL))
        staging[:12 * NUMEL].view(torch.float32).copy_(torch.randn(3 * NUMEL, generator=generator).abs())
        self.store.write(self.states[0], staging)
        self.initial = staging[:12 * NUMEL].view(torch.float32).clone()
        gradient = torch.randn(NUMEL, generator=generator).to(torch.bfloat16)  # exact in both dtypes
        staging[:element * NUMEL].view(grad_dtype).copy_(gradient)
        self.store.write(self.grad, staging)
        self.pipeline = UpdatePipeline(self.store, CpuAdamKernel(HYPER, adamw_mode=True),
                                       UpdateBuffers(self.store, NUMEL, NUMEL, NUMEL), self.host)

    def update(self, **options):
        out = self.states[-1]
        task = UpdateTask(1, 0, NUMEL, torch.bfloat16, [copy.copy(self.states[0])], [plan_write(out)], NUMEL,
                          copy.copy(self.grad), plan_write(self.params), 1, HYPER, 0.5, grad_dtype=self.grad_dtype,
                          **options)
        self.pipeline.add(task)
        self.pipeline.drain()
        return self.read(out), self.weights()

    def read(self, region):
        buffer = self.store.buffer(padded_size(12 * NUMEL))
        self.store.read(region, buffer)
        return buffer[:12 * NUMEL].view(torch.float32).clone()

    def weights(self):
        buffer = self.store.buffer(padded_size(2 * NUMEL))
        self.store.read(self.params, buffer)
        return buffer[:2 * NUMEL].view(torch.bfloat16).clone()


def test_an_update_in_place_gives_the_two_slot_bits(tmp_path):
    in_place = Layer(tmp_path / "one", slots=1)
    states, weights = in_place.update()
    two_slots = Layer(tmp_path / "two", slots=2)
    expected_states, expected_weights = two_slots.update()
    assert torch.equal(states, expected_states) and torch.equal(weights, expected_weights)
    assert not torch.equal(states, in_place.initial)  # it moved
    assert torch.equal(two_slots.read(two_slots.states[0]), two_slots.initial)  # the other slot kept the old states
    # The weights are the cast of the new master.
    assert torch.equal(weights, states[:NUMEL].to(torch.bfloat16))


def test_a_bf16_gradient_region_gives_the_fp32_one_bits(tmp_path):
    fp32 = Layer(tmp_path / "fp32", slots=1)
    bf16 = Layer(tmp_path / "bf16", slots=1, grad_dtype=torch.bfloat16)
    assert bf16.grad.padded_bytes < fp32.grad.padded_bytes
    for got, expected in zip(bf16.update(), fp32.update()):
        assert torch.equal(got, expected)


def test_a_recast_rewrites_the_weights_from_the_master_and_nothing_else(tmp_path):
    layer = Layer(tmp_path, slots=1)  # its gradient sits over its weights
    task = UpdateTask(1, 0, NUMEL, torch.bfloat16, [copy.copy(layer.states[0])], None, NUMEL, None,
                      plan_write(layer.params), 5, HYPER, 1.0, recast_only=True)
    grad_reads = layer.store.counters.reads["grad"]
    layer.pipeline.add(task)
    layer.pipeline.drain()
    assert torch.equal(layer.read(layer.states[0]), layer.initial)  # states untouched
    assert torch.equal(layer.weights(), layer.initial[:NUMEL].to(torch.bfloat16))
    assert layer.store.counters.reads["grad"] == grad_reads
