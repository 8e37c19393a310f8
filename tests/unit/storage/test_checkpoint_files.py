"""Checkpoint files without an engine: safe loading, re-cutting shards for another rank count, damaged
shards named, format 1 read, old checkpoints removed."""
import json
import os
import re

import numpy
import pytest
import torch

from ds_greedysnake.storage.checkpoint import (CheckpointError, CheckpointWriter, LayerState, read_full_layer,
                                               remove_old_checkpoints)
from ds_greedysnake.storage.checkpoint_format import open_checkpoint
from ds_greedysnake.runtime.parallel import ShardLayout


class CreatesFile:
    """Unpickling this creates ``path``: what a foreign checkpoint could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def full_layers(numels, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [LayerState(*(torch.randn(numel, generator=generator) for _ in range(3))) for numel in numels]


def shard_of(state: LayerState, layout: ShardLayout) -> LayerState:
    return LayerState(*(layout.own_shard(part) for part in (state.master, state.exp_avg, state.exp_avg_sq)))


def save(save_dir, tag, layers, world_size, state=None, latest=True):
    """A published format-2 checkpoint of these full layers as ``world_size`` ranks write it."""
    for rank in range(world_size):
        writer = CheckpointWriter(str(save_dir), tag, rank)
        if rank == 0:
            writer.prepare()
        for index, layer in enumerate(layers):
            numel = layer.master.numel()
            writer.write_layer(index, numel, world_size, shard_of(layer, ShardLayout(numel, world_size, rank)))
    writer = CheckpointWriter(str(save_dir), tag, 0)
    writer.write_state(state if state is not None else {"optimizer": {}, "lr_scheduler": None, "client_state": {}})
    writer.write_manifest(world_size, [layer.master.numel() for layer in layers],
                          {"global_steps": 3, "global_samples": 12, "skipped_steps": 0})
    return writer.publish(latest)


def assert_same(first: LayerState, second: LayerState):
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name


@pytest.mark.parametrize("saved_ranks", [1, 2, 3])
def test_read_full_layer_gathers_every_saved_shard(tmp_path, saved_ranks):
    layers = full_layers([10, 7, 1])
    save(tmp_path, "t", layers, saved_ranks)
    for index, layer in enumerate(layers):
        assert_same(read_full_layer(str(tmp_path), "t", index, layer.master.numel()), layer)


@pytest.mark.parametrize("saved_ranks,loading_ranks", [(3, 1), (3, 2), (3, 4), (2, 3), (1, 5)])
def test_a_shard_recut_for_another_rank_count_is_what_that_count_would_hold(tmp_path, saved_ranks, loading_ranks):
    layers = full_layers([10, 7])
    saved = open_checkpoint(save(tmp_path, "t", layers, saved_ranks))
    for index, layer in enumerate(layers):
        numel = layer.master.numel()
        for rank in range(loading_ranks):
            layout = ShardLayout(numel, loading_ranks, rank)
            start, stop = layout.shard_start, layout.shard_start + layout.shard_numel
            saved.check_layer(index, numel, start, stop)
            # Zero padding where the new layout pads, exactly as initialisation on that count would hold it.
            assert_same(saved.read_range(index, numel, start, stop), shard_of(layer, layout))


def test_a_layer_of_another_size_is_refused(tmp_path):
    saved = open_checkpoint(save(tmp_path, "t", full_layers([10]), 2))
    with pytest.raises(CheckpointError, match="layer 0 in .* has 10 parameters, the model's has 12"):
        saved.check_layer(0, 12, 0, 6)


def test_a_missing_or_truncated_shard_is_named(tmp_path):
    folder = save(tmp_path, "t", full_layers([10, 7]), 2)
    saved = open_checkpoint(folder)
    missing = os.path.join(folder, "layer_1.rank1.safetensors")
    os.remove(missing)
    with pytest.raises(CheckpointError, match=re.escape(f"shard {missing} is missing")):
        saved.check_layer(1, 7, 0, 7)
    saved.check_layer(1, 7, 0, 4)  # rank 0's half alone is whole
    truncated = os.path.join(folder, "layer_0.rank0.safetensors")
    with open(truncated, "r+b") as handle:
        handle.truncate(os.path.getsize(truncated) - 4)
    with pytest.raises(CheckpointError, match=re.escape(f"shard {truncated} is truncated or damaged")):
        read_full_layer(str(tmp_path), "t", 0, 10)


def test_a_shard_of_another_layer_or_rank_in_its_place_is_named(tmp_path):
    folder = save(tmp_path, "t", full_layers([8, 8]), 2)
    saved = open_checkpoint(folder)
    for wrong in ("layer_1.rank0.safetensors", "layer_0.rank1.safetensors"):
        os.replace(os.path.join(folder, wrong), os.path.join(folder, "layer_0.rank0.safetensors"))
        with pytest.raises(CheckpointError, match=re.escape(f"shard {folder}/layer_0.rank0.safetensors holds")):
            saved.check_layer(0, 8, 0, 8)


def test_a_state_file_with_a_foreign_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "created_by_unpickling"
    folder = save(tmp_path, "t", full_layers([4]), 1,
                  state={"optimizer": {}, "lr_scheduler": None, "client_state": {"payload": CreatesFile(str(marker))}})
    with pytest.raises(CheckpointError, match=r"state\.pt holds .*open.*trust_pickle=True"):
        open_checkpoint(folder).load_state()
    assert not marker.exists()
    state = open_checkpoint(folder, trust_pickle=True).load_state()
    assert marker.exists()
    state["client_state"]["payload"].close()


def test_numpy_scalars_and_plain_data_load_safely(tmp_path):
    client_state = {"loss": numpy.float64(2.5), "seen": numpy.int64(7), "flags": (True, None), "rng": torch.ones(3)}
    folder = save(tmp_path, "t", full_layers([4]), 1,
                  state={"optimizer": {"step_count": 3}, "lr_scheduler": {"last_epoch": 2},
                         "client_state": client_state})
    state = open_checkpoint(folder).load_state()
    assert state["client_state"]["loss"] == 2.5 and isinstance(state["client_state"]["loss"], numpy.float64)
    assert state["client_state"]["flags"] == (True, None) and torch.equal(state["client_state"]["rng"], torch.ones(3))
    assert (state["global_steps"], state["global_samples"], state["optimizer"]) == (3, 12, {"step_count": 3})


def save_format_1(folder, layers, world_size, client_state):
    """What ds_greedysnake wrote before format 2: per rank, pickled layer dicts and a state dict."""
    os.makedirs(folder)
    for rank in range(world_size):
        for index, layer in enumerate(layers):
            shard = shard_of(layer, ShardLayout(layer.master.numel(), world_size, rank))
            torch.save({"master": shard.master, "exp_avg": shard.exp_avg, "exp_avg_sq": shard.exp_avg_sq},
                       os.path.join(folder, f"layer_{index}.rank{rank}.pt"))
        torch.save({"num_layers": len(layers), "world_size": world_size, "global_steps": 5, "global_samples": 20,
                    "skipped_steps": 1, "optimizer": {"step_count": 4, "skipped_steps": 1, "param_groups": []},
                    "lr_scheduler": None, "client_state": client_state, "compute_dtype": "torch.float32",
                    "format_version": 1}, os.path.join(folder, f"state.rank{rank}.pt"))


def test_format_1_loads_safely_on_another_rank_count(tmp_path):
    layers = full_layers([9, 4])
    save_format_1(tmp_path / "old", layers, 2, {"micro_batches_consumed": 8})
    saved = open_checkpoint(str(tmp_path / "old"))
    assert saved.load_state()["client_state"] == {"micro_batches_consumed": 8}
    for index, layer in enumerate(layers):
        assert_same(read_full_layer(str(tmp_path), "old", index, layer.master.numel()), layer)
        layout = ShardLayout(layer.master.numel(), 3, 2)
        saved.check_layer(index, layer.master.numel(), layout.shard_start, layout.shard_start + layout.shard_numel)
        assert_same(saved.read_range(index, layer.master.numel(), layout.shard_start,
                                     layout.shard_start + layout.shard_numel), shard_of(layer, layout))


def test_format_1_with_a_foreign_pickle_is_refused(tmp_path):
    marker = tmp_path / "created_by_unpickling"
    save_format_1(tmp_path / "in_state", full_layers([4]), 1, {"payload": CreatesFile(str(marker))})
    with pytest.raises(CheckpointError, match=r"state\.rank0\.pt holds .*open"):
        open_checkpoint(str(tmp_path / "in_state"))
    save_format_1(tmp_path / "in_layer", full_layers([4]), 1, {})
    torch.save({"master": CreatesFile(str(marker))}, str(tmp_path / "in_layer" / "layer_0.rank0.pt"))
    with pytest.raises(CheckpointError, match=r"layer_0\.rank0\.pt holds .*open"):
        read_full_layer(str(tmp_path), "in_layer", 0, 4)
    assert not marker.exists()


def test_only_the_last_checkpoints_are_kept_never_the_latest(tmp_path):
    layers = full_layers([4])
    for tag in ("a", "b", "c"):
        save(tmp_path, tag, layers, 1)
    (tmp_path / "notes").mkdir()  # not a checkpoint: never counted or removed
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "state.rank0.pt").write_bytes(b"")
    (tmp_path / ".old.x.123").mkdir()  # left by a removal that was killed
    assert remove_old_checkpoints(str(tmp_path), 2, keep=["c"]) == ["a"]
    assert sorted(os.listdir(tmp_path)) == ["b", "c", "latest", "notes", "v1"]
    # Saved without moving 'latest': the one 'latest' names stays as well as the last two.
    save(tmp_path, "d", layers, 1, latest=False)
    save(tmp_path, "e", layers, 1, latest=False)
    assert (tmp_path / "latest").read_text() == "c"
    assert remove_old_checkpoints(str(tmp_path), 2, keep=["e"]) == ["b"]
    assert sorted(name for name in os.listdir(tmp_path) if name not in ("notes", "v1")) == ["c", "d", "e", "latest"]
    assert json.loads((tmp_path / "e" / "checkpoint.json").read_text())["format_version"] == 2
