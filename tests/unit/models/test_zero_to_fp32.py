"""zero_to_fp32 without an engine: a checkpoint written as the engine writes it (every layer's fp32 master,
sharded over W ranks, with its weights index) converts to DeepSpeed's outputs; DeepSpeed's own tool,
pointed at it, fails naming the command that works."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import tiny_model  # noqa: E402
from ds_greedysnake import (convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint,  # noqa: E402
                            load_state_dict_from_zero_checkpoint)
from ds_greedysnake.storage.checkpoint import CheckpointWriter, LayerState  # noqa: E402
from ds_greedysnake.models.model_split import plan_split  # noqa: E402
from ds_greedysnake.runtime.parallel import ShardLayout  # noqa: E402
from ds_greedysnake.models.weights import LayerSource, WeightPlan, layer_params_of  # noqa: E402
from ds_greedysnake.models.zero_to_fp32 import (RECOVERY_SCRIPT_NAME, ZeroToFp32Error, describe_weights,  # noqa: E402
                                         write_recovery_script)


def save_like_the_engine(model, save_dir, tag: str, world_size: int) -> None:
    """What engine.save_checkpoint writes for ``model``'s weights as masters (moments: random)."""
    layers = layer_params_of(plan_split(model))
    flats = [torch.cat([p.detach().reshape(-1).float() for p in layer.params]) for layer in layers]
    plan = WeightPlan(model, LayerSource(layers, lambda index: flats[index].clone()))
    for rank in range(world_size):
        writer = CheckpointWriter(str(save_dir), tag, rank)
        if rank == 0:
            writer.prepare()
        for index, flat in enumerate(flats):
            layout = ShardLayout(flat.numel(), world_size, rank)
            state = LayerState(flat, torch.randn_like(flat), torch.rand_like(flat))
            writer.write_layer(index, flat.numel(), world_size,
                               LayerState(*(layout.own_shard(part) for part in (state.master, state.exp_avg,
                                                                                 state.exp_avg_sq))))
    writer = CheckpointWriter(str(save_dir), tag, 0)
    writer.write_state({"optimizer": {}, "lr_scheduler": None, "client_state": {}})
    writer.write_weights_index(*describe_weights(plan))
    writer.write_manifest(world_size, [flat.numel() for flat in flats],
                          {"global_steps": 1, "global_samples": 2, "skipped_steps": 0})
    writer.publish(True)
    write_recovery_script(str(save_dir))


def with_buffer(model):
    """A persistent buffer (HF's tiny models have none left): it must come out as saved."""
    model.lm_head.register_buffer("steps_seen", torch.tensor([3, 5], dtype=torch.int64))
    return model


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_state_dict_is_the_models_with_tied_keys_sharing_one_tensor(tmp_path, world_size):
    model = with_buffer(tiny_model("gpt2"))  # lm_head.weight is tied to transformer.wte.weight
    save_like_the_engine(model, tmp_path, "global_step1", world_size)
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    expected = model.state_dict()
    assert set(state_dict) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state_dict[key], value), key
    assert state_dict["lm_head.weight"] is state_dict["transformer.wte.weight"]
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="global_step1", lazy_mode=True)
    assert torch.equal(lazy["transformer.h.1.mlp.c_fc.weight"].contiguous(), expected["transformer.h.1.mlp.c_fc.weight"])
    fresh = load_state_dict_from_zero_checkpoint(with_buffer(tiny_model("gpt2", seed=1)), str(tmp_path))
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_the_outputs_are_deepspeeds_names_shards_and_index(tmp_path):
    """Sharded as DeepSpeed's tool shards (huggingface_hub's split in state-dict order, buffers first),
    .bin and safetensors, the latter loadable with from_pretrained once config.json is beside it."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    model = tiny_model("llama")
    save_like_the_engine(model, tmp_path / "ckpt", "global_step1", 2)
    written = convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "bin"),
                                                         max_shard_size="40KB")
    expected = split_torch_state_dict_into_shards(model.state_dict(), filename_pattern="pytorch_model{suffix}.bin",
                                                  max_shard_size="40KB")
    assert expected.is_sharded and sorted(written) == sorted(list(expected.filename_to_tensors) +
                                                             ["pytorch_model.bin.index.json"])
    index = json.loads((tmp_path / "bin" / "pytorch_model.bin.index.json").read_text())
    assert index == {"metadata": expected.metadata, "weight_map": expected.tensor_to_filename}
    for name, keys in expected.filename_to_tensors.items():
        shard = torch.load(str(tmp_path / "bin" / name), weights_only=True)
        assert list(shard) == keys
        for key in keys:
            assert torch.equal(shard[key], model.state_dict()[key]), key
    convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "st"), safe_serialization=True)
    assert sorted(os.listdir(tmp_path / "st")) == ["model.safetensors"]  # 5GB: one file
    assert set(load_file(str(tmp_path / "st" / "model.safetensors"))) == set(model.state_dict())
    model.config.save_pretrained(str(tmp_path / "st"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "st"), dtype=torch.float32)
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


def test_the_script_in_the_folder_has_deepspeeds_command_line(tmp_path):
    model = tiny_model("gpt2")
    save_like_the_engine(model, tmp_path / "checkpoint-1", "global_step1", 1)
    script = tmp_path / "checkpoint-1" / RECOVERY_SCRIPT_NAME
    assert os.access(script, os.X_OK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=env)
    assert done.returncode == 0
    for flag in ("checkpoint_dir", "output_dir", "--max_shard_size", "--safe_serialization", "-t TAG, --tag TAG",
                 "--exclude_frozen_parameters", "-d, --debug"):
        assert flag in done.stdout, flag
    done = subprocess.run([sys.executable, str(script), ".", str(tmp_path / "out"), "--safe_serialization", "-t",
                           "global_step1"], capture_output=True, text=True, env=env, cwd=str(tmp_path / "checkpoint-1"))
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(tmp_path / "x")], capture_output=True,
                          text=True, env=env)
    assert done.returncode == 1 and "no 'latest' file" in done.stderr  # the folder above: said, no traceback


def test_deepspeeds_own_tool_names_the_command_that_works(tmp_path):
    from deepspeed.utils import zero_to_fp32 as deepspeeds
    save_like_the_engine(tiny_model("gpt2"), tmp_path, "global_step1", 1)
    with pytest.raises(ValueError) as raised:
        deepspeeds.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert "python_zero_to_fp32.py_in_the_folder_above" in str(raised.value)
    assert "ds_greedysnake_checkpoint" in str(raised.value)


def test_frozen_parameters_are_not_silently_left_out(tmp_path):
    model = tiny_model("gpt2")
    model.transformer.wpe.weight.requires_grad_(False)
    save_like_the_engine_trainable_only(model, tmp_path)
    with pytest.raises(ZeroToFp32Error, match="transformer.wpe.weight.*--exclude_frozen_parameters"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), exclude_frozen_parameters=True)
    assert "transformer.wpe.weight" not in state_dict
    assert torch.equal(state_dict["transformer.h.0.attn.c_attn.weight"],
                       model.state_dict()["transformer.h.0.attn.c_attn.weight"])


def save_like_the_engine_trainable_only(model, save_dir):
    """As the engine: each layer's checkpoint vector is its trainable parameters (frozen ones come after)."""
    layers = layer_params_of(plan_split(model))
    plan = WeightPlan(model, LayerSource(layers, lambda index: None))
    writer = CheckpointWriter(str(save_dir), "global_step1", 0)
    writer.prepare()
    numels = []
    for index, layer in enumerate(layers):
        trainable = [p for p in layer.params if p.requires_grad]
        flat = torch.cat([p.detach().reshape(-1).float() for p in trainable]) if trainable else torch.zeros(0)
        numels.append(flat.numel())
        if flat.numel():
            writer.write_layer(index, flat.numel(), 1, LayerState(flat, flat.clone(), flat.clone()))
    writer.write_state({"optimizer": {}, "lr_scheduler": None, "client_state": {}})
    writer.write_weights_index(*describe_weights(plan))
    writer.write_manifest(1, numels, {"global_steps": 1, "global_samples": 2, "skipped_steps": 0})
    writer.publish(True)


def test_an_older_checkpoint_names_the_export_command(tmp_path):
    writer = CheckpointWriter(str(tmp_path), "old", 0)
    writer.prepare()
    writer.write_layer(0, 4, 1, LayerState(torch.ones(4), torch.ones(4), torch.ones(4)))
    writer.write_state({"optimizer": {}, "lr_scheduler": None, "client_state": {}})
    writer.write_manifest(1, [4], {"global_steps": 1, "global_samples": 2, "skipped_steps": 0})
    writer.publish(True)
    with pytest.raises(ZeroToFp32Error, match="python -m ds_greedysnake.export --checkpoint"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
