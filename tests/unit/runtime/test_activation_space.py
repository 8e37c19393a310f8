"""The disk is checked for a step's whole activation spill before its first spill file is created."""
import collections
import os

import pytest
import torch

from ds_greedysnake.deepspeed_compat import AioSettings
from ds_greedysnake.runtime import activations
from ds_greedysnake.runtime.activations import ActivationStore
from ds_greedysnake.storage.ssd import IoCounters, SsdIoError, SsdStore, padded_size

Usage = collections.namedtuple("usage", "total used free")


def test_a_spill_the_disk_cannot_hold_fails_before_any_file_naming_needed_and_free(tmp_path, monkeypatch):
    tensor = torch.randn(2, 16, 32)  # 4096 bytes: padded with its tag to 8192
    needed = 2 * 3 * padded_size(4096)  # layers 1 and 2, three micro-batches, budget 0
    monkeypatch.setattr(activations.shutil, "disk_usage", lambda path: Usage(1 << 30, 0, needed - 1))
    store = ActivationStore(SsdStore(str(tmp_path), AioSettings(), IoCounters(), "act"), 0, torch.device("cpu"),
                            layer_inputs=2, micro_batches=3)
    with pytest.raises(SsdIoError, match=f"allocate {needed} bytes for .*act_act_l1_m0.bin .* {needed - 1} bytes free"):
        store.put(1, 0, tensor)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".bin")]
    monkeypatch.setattr(activations.shutil, "disk_usage", lambda path: Usage(1 << 30, 0, needed))
    fits = ActivationStore(SsdStore(str(tmp_path), AioSettings(), IoCounters(), "act"), 0, torch.device("cpu"),
                           layer_inputs=2, micro_batches=3)
    for layer in (1, 2):
        for micro_batch in range(3):
            fits.put(layer, micro_batch, tensor)
    assert torch.equal(fits.take(1, 0), tensor)
