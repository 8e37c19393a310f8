import pytest
import torch

from ds_greedysnake.activations import ActivationStore
from ds_greedysnake.ssd import IoCounters, SsdStore


@pytest.mark.parametrize("budget_bytes", [0, 3 * 4096, 1 << 30])
def test_checkpoints_come_back_exactly_whatever_the_budget(tmp_path, budget_bytes):
    counters = IoCounters()
    store = ActivationStore(SsdStore(str(tmp_path), {}, counters, "act"), budget_bytes, torch.device("cpu"))
    tensors = {(layer, mb): torch.randn(2, 16, 32) for layer in (1, 2) for mb in range(3)}
    for key, tensor in tensors.items():
        store.put(*key, tensor)
    assert store.host_bytes <= budget_bytes
    assert torch.equal(store.peek(1, 0), tensors[(1, 0)])
    for key in sorted(tensors, reverse=True):
        assert torch.equal(store.take(*key), tensors[key])
    assert store.host_bytes == 0
    spilled = counters.writes["activation"]
    assert (spilled == 0) == (budget_bytes >= 6 * 2 * 16 * 32 * 4)
    # Each spilled checkpoint is read back once, except the last one put, which is still on the
    # device (the snake hand-off); peek(1, 0) reads once more when (1, 0) was spilled.
    last_put_on_device = 1 if spilled else 0
    peek_read = 1 if budget_bytes == 0 else 0
    assert counters.reads["activation"] == spilled - last_put_on_device + peek_read


def test_bf16_checkpoints_spill(tmp_path):
    store = ActivationStore(SsdStore(str(tmp_path), {}, IoCounters(), "act"), 0, torch.device("cpu"))
    tensor = torch.randn(3, 5, 7).to(torch.bfloat16)
    store.put(1, 0, tensor)
    store.put(1, 1, tensor + 1)
    assert torch.equal(store.take(1, 0), tensor)
    assert torch.equal(store.take(1, 1), tensor + 1)
