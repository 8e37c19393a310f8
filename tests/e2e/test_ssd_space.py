"""SSD space: layers updated in place (one slot) give the two-slot engine's and the synchronous step's bits,
through a skipped step; the bytes on disk are the layout's, and with clipping on at most ZeRO-Infinity's;
a disk too small fails at initialize, naming the bytes needed and free."""
import collections
import dataclasses
import os

import pytest
import torch

from ds_greedysnake.runtime import optimizer as optimizer_module
from ds_greedysnake.storage import ssd_layout
from ds_greedysnake.planner.shapes import GPTShape
from ds_greedysnake.planner.ssd_space import ssd_bytes, zero_infinity_ssd_bytes
from ds_greedysnake.settings import settings_from_ds_config
from greedysnake_run import make_engine
from zero_infinity_run import make_zero_infinity_engine
from helpers import MICRO_BATCH_SIZE, data, ds_config, fresh_model, tiny_gpt_config

pytestmark = pytest.mark.slow

# Gradients and optimizer states through SSD: every region kind is exercised.
ON_SSD = {"gradient_host_memory_mb": 0, "optimizer_host_memory_mb": 0}


def force_two_slots(monkeypatch):
    """The engine as it was before one-slot layers: two parameter and two state slots for every layer."""
    original = optimizer_module.plan_layout
    monkeypatch.setattr(optimizer_module, "plan_layout",
                        lambda numels, settings, frozen=None: original(
                            numels, dataclasses.replace(settings, in_place_layers=0), frozen))


def train_through_a_skipped_step(nvme_path, clipping, **greedysnake):
    """4 steps; step 2 gets an inf in the last layer's gradient (flushed first: with clipping off its update
    is speculative and must be discarded). Masters after steps 1, 2 and 4 (only the first two flush early,
    so steps 3 and 4 run with their updates overlapping the next forward)."""
    engine, batches = make_engine(nvme_path, 2, clipping=clipping, greedysnake=dict(ON_SSD, **greedysnake))
    layer = engine.layers[-1]
    original = layer.take_grads

    def poisoned():
        grads = original()
        grads[0] = float("inf")
        return grads

    losses, masters = [], []
    for step in range(1, 5):
        layer.take_grads = poisoned if step == 2 else original
        losses.append(float(engine.train_batch(batches)))
        assert engine.last_step_metrics.skipped == (step == 2)
        if step <= 2:
            masters.append(engine.master_parameters())
    masters.append(engine.master_parameters())
    in_place = [placed.in_place for placed in engine.optimizer.layout.layers]
    engine.close()
    return losses, masters, in_place


def assert_same(first, second):
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("clipping", [0.0, 1.0])
def test_one_slot_layers_give_the_two_slot_and_synchronous_bits_through_a_skipped_step(tmp_path, monkeypatch,
                                                                                        clipping):
    overlapped = {"deferred_layers": 2, "optimizer_read_ahead_mb": 64}
    one_slot = train_through_a_skipped_step(str(tmp_path / "one"), clipping, **overlapped)
    synchronous = train_through_a_skipped_step(str(tmp_path / "sync"), clipping, optimizer_overlap=False)
    with monkeypatch.context() as patch:
        force_two_slots(patch)
        two_slots = train_through_a_skipped_step(str(tmp_path / "two"), clipping, **overlapped)
    # With clipping every layer waits for the decision; without, the two front (deferred) layers do.
    assert one_slot[2] == ([True] * 5 if clipping else [True, True, False, False, False])
    assert synchronous[2] == [True] * 5 and two_slots[2] == [False] * 5
    losses, masters, _ = one_slot
    assert_same(masters[0], masters[1])  # the skipped step changed nothing
    assert not torch.equal(masters[2]["1.qkv.weight"], masters[1]["1.qkv.weight"])  # the others trained
    for other in (two_slots, synchronous):
        assert other[0] == losses
        for mine, theirs in zip(masters, other[1]):
            assert_same(mine, theirs)


def allocated_bytes(folder):
    """Bytes the files under ``folder`` take on disk (blocks allocated), their sizes, and how many files."""
    allocated = size = files = 0
    for root, _, names in os.walk(folder):
        for name in names:
            status = os.stat(os.path.join(root, name))
            allocated += status.st_blocks * 512
            size += status.st_size
            files += 1
    return allocated, size, files


# Blocks a file system may add to a file's count for its own bookkeeping when a write turns fallocate's
# unwritten extents into written ones (ext4 counts an extent-tree block in st_blocks): one per file.
METADATA_BLOCK = 4096


HIDDEN = 512  # every matrix but one per block reaches ZeRO-3's 1 MiB swap threshold in bf16


def greedysnake_bytes(nvme_path, clipping, **greedysnake):
    engine, batches = make_engine(nvme_path, 2, hidden=HIDDEN, clipping=clipping, bf16=True,
                                  greedysnake=dict(ON_SSD, **greedysnake))
    after_initialize = allocated_bytes(nvme_path)
    planned = dict(engine.optimizer.ssd_bytes)
    bins = sum(os.path.getsize(os.path.join(engine.swap_folder, name)) for name in os.listdir(engine.swap_folder)
               if name.endswith(".bin"))
    engine.train_batch(batches)
    after_step = allocated_bytes(nvme_path)
    engine.close()
    return after_initialize, after_step, planned, bins


def zero_infinity_bytes(nvme_path, clipping):
    engine, config = make_zero_infinity_engine(nvme_path, 2, HIDDEN, clipping=clipping, bf16=True)
    after_initialize = allocated_bytes(nvme_path)
    engine.train_batch(data(config))  # its gradient swap files appear in the first backward
    return after_initialize, allocated_bytes(nvme_path)


def test_ssd_bytes_per_parameter_against_zero_infinity(tmp_path):
    config = tiny_gpt_config(HIDDEN)
    params = sum(p.numel() for p in fresh_model(config).parameters())
    clip_on = greedysnake_bytes(str(tmp_path / "gs_clip"), 1.0)
    clip_off = greedysnake_bytes(str(tmp_path / "gs_noclip"), 0.0)
    zero = zero_infinity_bytes(str(tmp_path / "zi"), 1.0)
    per_parameter = {"greedysnake, clipping on": clip_on[0][0] / params,
                     "greedysnake, clipping off": clip_off[0][0] / params,
                     "ZeRO-Infinity after initialize": zero[0][0] / params,
                     "ZeRO-Infinity after its first step": zero[1][0] / params}
    print({key: round(value, 3) for key, value in per_parameter.items()})
    for after_initialize, after_step, planned, bins in (clip_on, clip_off):
        assert bins == sum(planned.values())  # the files are what initialize planned, checked and logged
        # Nothing grows once training runs: no file appears or grows, and no data block is added (a clean CI
        # clone once saw one file's count rise by one 4 KiB block, the file system's extent bookkeeping).
        assert after_step[1:] == after_initialize[1:]
        assert after_initialize[0] <= after_step[0] <= after_initialize[0] + METADATA_BLOCK * after_step[2]
    # The planner computes the same for the model unbuilt.
    shape = GPTShape("tiny", num_blocks=config.num_layers, hidden=HIDDEN, heads=config.num_heads,
                     vocab=config.vocab_size, seq_len=config.seq_len)
    checkpoint_bytes = MICRO_BATCH_SIZE * config.seq_len * HIDDEN * 2
    ds = ds_config("unused", 2, clipping=1.0, bf16=True, greedysnake=ON_SSD)
    settings = settings_from_ds_config(ds)
    assert ssd_bytes([layer.params for layer in shape.layers], settings, 2, checkpoint_bytes) == clip_on[2]
    # Clipping on: every layer in one slot, its gradient in its parameter file: 16 B per parameter, at most
    # what ZeRO-Infinity's files hold once it has trained (18 B per parameter it swaps: 2 B bf16 weights,
    # 12 B optimizer states, 4 B fp32 gradient). Right after its initialize ZeRO-Infinity holds less: it
    # creates its gradient files in the first backward.
    assert per_parameter["greedysnake, clipping on"] <= per_parameter["ZeRO-Infinity after its first step"]
    assert 16 <= per_parameter["greedysnake, clipping on"] < 16.1
    # The planner's account of ZeRO-Infinity's swap rules (1 MiB threshold, sub-groups) is what its files hold.
    estimate = sum(zero_infinity_ssd_bytes([p.numel() for p in fresh_model(config).parameters()], bf16=True,
                                           sub_group_size=1).values())
    assert abs(zero[1][1] - estimate) <= 0.01 * estimate, (zero[1][1], estimate)
    # Clipping off, the overlap on: the speculative layers (all but the front quarter) keep two slots and a
    # gradient region: 32 B per parameter for them.
    assert 31 < per_parameter["greedysnake, clipping off"] < 32.1


def test_a_disk_too_small_fails_at_initialize_with_needed_and_free_bytes(tmp_path, monkeypatch):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(ssd_layout.shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 123_456, 123_456))
    with pytest.raises(ssd_layout.SsdSpaceError,
                       match=r"need [\d,]+ bytes \(0\.\d\d GiB\) under .*greedysnake/rank0, and 123,456 bytes"):
        make_engine(str(tmp_path), 2, greedysnake=ON_SSD)
    folder = tmp_path / "greedysnake" / "rank0"
    assert not [name for name in os.listdir(folder) if name.endswith(".bin")], "nothing may be allocated"
