"""Weights in and out without an engine: the HF writer, the pretrained reader, the checkpoint reader."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from hf_models import FAMILIES, tiny_model  # noqa: E402
from ds_greedysnake.models.export import plan_shards, saved_keys, shard_names, write_hf_checkpoint  # noqa: E402
from ds_greedysnake.models.model_split import plan_split  # noqa: E402
from ds_greedysnake.models.pretrained import PretrainedWeights, PretrainedWeightsError, empty_model  # noqa: E402
from ds_greedysnake.models.weights import LayerSource, WeightPlan, layer_params_of  # noqa: E402


def test_shards_are_filled_in_order_and_a_big_tensor_gets_its_own():
    sizes = [("a", 40), ("b", 50), ("c", 20), ("d", 300), ("e", 10), ("f", 100)]
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"], ["f"]]
    assert plan_shards(sizes, 10_000) == [["a", "b", "c", "d", "e", "f"]]
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(3)[1] == "model-00002-of-00003.safetensors"


def in_memory_plan(model):
    """The model's own weights as a layer source (what the engine reads from SSD)."""
    layers = layer_params_of(plan_split(model))
    flats = [torch.cat([p.detach().reshape(-1).float() for p in layer.params]) for layer in layers]
    return WeightPlan(model, LayerSource(layers, lambda index: flats[index].clone()))


def file_tensors(folder):
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as handle:
                tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return dict(sorted(tensors.items()))


@pytest.mark.parametrize("family", FAMILIES)
def test_writer_writes_what_hf_writes_and_hf_loads_it(tmp_path, family):
    """Same keys as HF's own save_pretrained (tied aliases left out by HF's rule), bitwise the same
    tensors, sharded with an index when asked, and AutoModelForCausalLM loads it back."""
    from transformers import AutoModelForCausalLM
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "hf")
    files = write_hf_checkpoint(in_memory_plan(model), str(tmp_path / "ours"), torch.float32, max_shard_size="100KB")
    ours, theirs = file_tensors(tmp_path / "ours"), file_tensors(tmp_path / "hf")
    assert set(ours) == set(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    assert len(files) > 2 and "model.safetensors.index.json" in files  # sharded
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(theirs)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["dtype"] == "float32"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").state_dict()
    for name, original in model.state_dict().items():
        assert torch.equal(reloaded[name], original), name


def test_writer_casts_and_removes_stale_shards(tmp_path):
    model = tiny_model("llama")
    out = str(tmp_path / "out")
    write_hf_checkpoint(in_memory_plan(model), out, torch.float32, max_shard_size="100KB")
    write_hf_checkpoint(in_memory_plan(model), out, torch.bfloat16)  # one file now
    assert sorted(name for name in os.listdir(out) if "safetensors" in name) == ["model.safetensors"]
    tensors = file_tensors(out)
    assert all(value.dtype == torch.bfloat16 for value in tensors.values())
    assert torch.equal(tensors["lm_head.weight"], model.lm_head.weight.detach().to(torch.bfloat16))
    assert json.loads(open(os.path.join(out, "config.json")).read())["dtype"] == "bfloat16"


def test_saved_keys_stream_layer_by_layer():
    model = tiny_model("gpt2")
    keys = saved_keys(in_memory_plan(model))
    assert keys[0].startswith("transformer.wte") and "lm_head.weight" not in keys
    assert keys.index("transformer.h.0.ln_1.weight") < keys.index("transformer.h.1.ln_1.weight")


def test_empty_model_has_meta_parameters_and_real_buffers():
    from hf_models import tiny_config
    model = empty_model(tiny_config("llama"))
    assert all(param.is_meta for param in model.parameters())
    reference = tiny_model("llama")
    for (name, buffer), (_, expected) in zip(model.named_buffers(), reference.named_buffers()):
        assert not buffer.is_meta and torch.equal(buffer, expected), name
    assert model.lm_head.weight.shape == reference.lm_head.weight.shape


def test_pretrained_weights_read_each_layer_in_split_order(tmp_path):
    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    skeleton = empty_model(str(tmp_path))
    weights = PretrainedWeights(tmp_path, skeleton)
    for layer, original in zip(layer_params_of(plan_split(skeleton)), layer_params_of(plan_split(model))):
        expected = torch.cat([p.detach().reshape(-1) for p in original.params])
        assert torch.equal(weights.flat_weights(layer.params, torch.float32), expected)


def test_pretrained_folder_errors_name_the_problem(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(PretrainedWeightsError, match="neither model.safetensors"):
        PretrainedWeights(tmp_path, model)
    tensors = {key: value.clone() for key, value in model.state_dict().items() if key != "model.norm.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(PretrainedWeightsError, match="model.norm.weight"):
        PretrainedWeights(tmp_path, model)
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(PretrainedWeightsError, match="other shapes.*model.norm.weight"):
        PretrainedWeights(tmp_path, model)


def test_initialize_refuses_meta_weights_without_a_folder_and_a_wrong_folder(tmp_path):
    import ds_greedysnake
    from hf_models import tiny_config
    from helpers import ds_config
    from ds_greedysnake.models.hf import hf_causal_lm_loss
    model = empty_model(tiny_config("llama"))
    config = ds_config(str(tmp_path), 2)
    with pytest.raises(ValueError, match="meta device.*pretrained="):
        ds_greedysnake.initialize(model=model, config=config, loss_fn=hf_causal_lm_loss)
    with pytest.raises(PretrainedWeightsError, match="neither model.safetensors"):
        ds_greedysnake.initialize(model=model, config=config, loss_fn=hf_causal_lm_loss, pretrained=str(tmp_path))
    with pytest.raises(ValueError, match="needs the greedysnake engine"):
        ds_greedysnake.initialize(model=model, config=ds_config(str(tmp_path), 2, enabled=False),
                                  loss_fn=hf_causal_lm_loss, pretrained=str(tmp_path))


def _placeholder_model(world_size=1):
    """A tiny HF model whose parameters hold empty placeholders, its weights behind a layer source
    (what the engine leaves): the module's state_dict() and GatheredParameters must still give them."""
    from ds_greedysnake.models.weights import ModuleWeightAccess
    model = tiny_model("gpt2")
    original = {key: value.clone() for key, value in model.state_dict().items()}
    plan = in_memory_plan(model)
    for param in model.parameters():
        param.data = torch.empty(0)
    access = ModuleWeightAccess(model, plan, torch.float32, torch.device("cpu"), world_size, lambda index: False)
    return model, original, access


def test_state_dict_and_gathered_parameters_give_the_weights_behind_placeholders():
    import deepspeed
    from ds_greedysnake.models.weights import WeightsAccessError
    model, original, _ = _placeholder_model()
    state = model.state_dict()
    assert list(state) == list(original)
    for key, value in original.items():
        assert torch.equal(state[key], value), key
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    block = model.transformer.h[0].state_dict()
    assert torch.equal(block["attn.c_attn.weight"], original["transformer.h.0.attn.c_attn.weight"])
    assert all(isinstance(value, torch.nn.Parameter) for key, value in model.state_dict(keep_vars=True).items()
               if key in dict(model.named_parameters()))  # keep_vars callers get the parameters themselves
    with deepspeed.zero.GatheredParameters(model.parameters()):
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), original[name]), name
    assert all(param.numel() == 0 for param in model.parameters())
    with pytest.raises(WeightsAccessError, match="pretrained=dir"):
        model.load_state_dict(original)


def test_state_dict_on_several_ranks_names_the_collective_calls():
    from ds_greedysnake.models.weights import WeightsAccessError
    model, _, _ = _placeholder_model(world_size=2)
    with pytest.raises(WeightsAccessError, match="2 ranks.*save_pretrained.*_zero3_consolidated_16bit_state_dict"):
        model.state_dict()
    with pytest.raises(WeightsAccessError):
        model.transformer.h[0].state_dict()
