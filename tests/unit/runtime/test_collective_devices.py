"""Every tensor handed to a collective lives on the engine's device (NCCL takes no host tensor).

The collectives are a recording double; the device is "meta" under torch's fake-tensor mode, so that a
host tensor handed to a collective shows on the CPU, as it would fail under NCCL on a GPU."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ds_greedysnake import deepspeed_compat
from ds_greedysnake.runtime import parallel as parallel_module
from ds_greedysnake.runtime.engine import GreedySnakeEngine
from ds_greedysnake.runtime.parallel import DataParallel

DEVICE = torch.device("meta")


class RecordingCollectives:
    """deepspeed.comm as greedysnake calls it: records (collective, device) of every tensor handed over."""

    def __init__(self, rank: int = 0, fill=None):
        self.rank = rank
        self.fill = fill
        self.handed = []

    def all_gather_into_tensor(self, output, tensor, group=None):
        self.handed += [("all_gather", output.device), ("all_gather", tensor.device)]

    def reduce_scatter_tensor(self, output, tensor, group=None):
        self.handed += [("reduce_scatter", output.device), ("reduce_scatter", tensor.device)]

    def all_reduce(self, tensor, group=None):
        self.handed.append(("all_reduce", tensor.device))

    def broadcast(self, tensor, src, group=None):
        self.handed.append(("broadcast", tensor.device))
        if self.fill is not None:
            tensor.fill_(self.fill)

    def barrier(self, group=None):
        pass

    def get_rank(self, group=None):
        return self.rank

    def devices(self):
        return {device for _, device in self.handed}


@pytest.fixture
def collectives(monkeypatch):
    recording = RecordingCollectives()
    monkeypatch.setattr(parallel_module, "dist", recording)
    return recording


def test_gather_to_host_gathers_on_the_device_and_comes_back(collectives):
    with FakeTensorMode():
        parallel = DataParallel(2, 0, DEVICE)
        host_shard = torch.zeros(parallel.layout(10).shard_numel)
        full = parallel.gather_to_host(host_shard, parallel.layout(10))
    assert collectives.handed and collectives.devices() == {DEVICE}
    assert full.device.type == "cpu" and full.numel() == 10


def test_master_parameters_hands_the_collective_device_tensors(collectives):
    with FakeTensorMode():
        module = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
        parallel = DataParallel(2, 0, DEVICE)
        layers = []
        for index, block in enumerate(module):
            params = list(block.parameters())
            numel = sum(p.numel() for p in params)
            layers.append(SimpleNamespace(index=index, params=params, param_shapes=[p.shape for p in params],
                                          numel=numel, layout=parallel.layout(numel), trainable=True,
                                          frozen_params=[], frozen_shapes=[], frozen_numel=0))
        optimizer = SimpleNamespace(read_master=lambda layer: torch.zeros(layer.layout.shard_numel))  # host, as SSD's
        engine = SimpleNamespace(flush=lambda: None, module=module, layers=layers, parallel=parallel,
                                 optimizer=optimizer)
        engine._read_full_master = lambda index: GreedySnakeEngine._read_full_master(engine, index)
        engine._read_trainable_master = lambda index: GreedySnakeEngine._read_trainable_master(engine, index)
        masters = GreedySnakeEngine.master_parameters(engine)
    assert [name for name, _ in collectives.handed].count("all_gather") == 4
    assert collectives.devices() == {DEVICE}, collectives.handed
    assert set(masters) == {name for name, _ in module.named_parameters()}
    assert {value.device.type for value in masters.values()} == {"cpu"}


def test_the_step_collectives_take_device_tensors(collectives):
    with FakeTensorMode():
        parallel = DataParallel(2, 1, DEVICE)
        layout = parallel.layout(12)
        parallel.gather(torch.zeros(layout.shard_numel, device=DEVICE), layout)
        parallel.reduce_scatter_mean(torch.zeros(layout.padded_numel, device=DEVICE), layout)
    assert collectives.devices() == {DEVICE}


def test_the_model_broadcast_goes_through_the_device_in_pieces(monkeypatch):
    recording = RecordingCollectives(rank=1)
    monkeypatch.setattr(deepspeed_compat, "dist", recording)
    monkeypatch.setattr(deepspeed_compat, "accelerator_device", lambda: DEVICE)
    monkeypatch.setattr(deepspeed_compat.groups, "_get_broadcast_src_rank", lambda: 0)
    monkeypatch.setattr(deepspeed_compat, "BROADCAST_PIECE_BYTES", 16)
    with FakeTensorMode():
        module = nn.Linear(3, 2)  # 24 + 8 bytes of fp32
        engine = SimpleNamespace(dist_backend="nccl", module=module, seq_data_parallel_group=None,
                                 weights_come_from_files=False)
        deepspeed_compat.EngineBase._broadcast_model(engine)
    assert recording.handed == [("broadcast", DEVICE)] * 3  # 16 + 8 bytes of the weight, 8 of the bias


def test_a_receiving_rank_gets_the_broadcast_weights_in_place(monkeypatch):
    monkeypatch.setattr(deepspeed_compat, "dist", RecordingCollectives(rank=1, fill=7))
    monkeypatch.setattr(deepspeed_compat, "BROADCAST_PIECE_BYTES", 12)
    host = torch.zeros(10, dtype=torch.float32)  # each piece is copied (to the device), filled, copied back
    deepspeed_compat.broadcast_through_device(host, torch.device("cpu"), 0, None)
    assert torch.equal(host.view(torch.uint8), torch.full((40,), 7, dtype=torch.uint8))
