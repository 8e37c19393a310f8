"""The Hugging Face split: which modules land in which layer, and the layers compose to the model."""
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from hf_models import FAMILIES, SEQ_LEN, VOCAB, tiny_config, tiny_model  # noqa: E402
from ds_greedysnake.models.model_split import ModelSplitError, plan_split  # noqa: E402
from ds_greedysnake.models.hf import HfBlock, HfHead, HfInputLayer, hf_causal_lm_loss  # noqa: E402

# Where each family's pieces land, by parameter name prefix.
EXPECTED = {
    "gpt2": (["transformer.wte", "transformer.wpe"], "transformer.h", ["transformer.ln_f", "lm_head"], True),
    "llama": (["model.embed_tokens"], "model.layers", ["model.norm", "lm_head"], False),
    "opt": (["model.decoder.embed_tokens", "model.decoder.embed_positions"], "model.decoder.layers",
            ["model.decoder.final_layer_norm", "lm_head"], True),
    "gpt_neox": (["gpt_neox.embed_in"], "gpt_neox.layers", ["gpt_neox.final_layer_norm", "lm_head"], False),
}


def _module_names(model, params):
    """The modules (by the model's own names; a tied weight by its first name) holding ``params``."""
    wanted = {id(p) for p in params}
    return {name.rsplit(".", 1)[0] for name, p in model.named_parameters() if id(p) in wanted}


@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_land_in_the_right_layers(family):
    model = tiny_model(family)
    split = plan_split(model)
    inputs, blocks, head, tied = EXPECTED[family]
    assert isinstance(split.layers[0], HfInputLayer) and isinstance(split.layers[-1], HfHead)
    assert all(isinstance(layer, HfBlock) for layer in split.layers[1:-1]) and len(split.layers) == 4
    assert _module_names(model, split.layers[0].parameters()) == set(inputs)
    for index, layer in enumerate(split.layers[1:-1]):
        assert all(name.startswith(f"{blocks}.{index}.") for name in _module_names(model, layer.parameters()))
    own = [p for p in split.layers[-1].parameters() if all(p is not q for q in split.borrowed_by(3))]
    assert _module_names(model, own) == set(head) - ({"lm_head"} if tied else set())
    assert bool(split.ties) == tied
    if tied:
        assert split.ties[0].params == (model.get_input_embeddings().weight,)


@pytest.mark.parametrize("family", FAMILIES)
def test_layers_compose_to_the_model(family):
    """Running the layers one after another gives HF's own logits and loss, exactly."""
    model = tiny_model(family).eval()
    layers = plan_split(model).layers
    input_ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=input_ids, labels=input_ids)
        hidden = input_ids
        for layer in layers:
            hidden = layer(hidden)
    torch.testing.assert_close(hidden, expected.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(hf_causal_lm_loss(hidden, input_ids), expected.loss, rtol=0, atol=1e-6)


def test_gradients_through_the_split_match_the_model():
    model = tiny_model("llama")
    input_ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    hidden = input_ids
    for layer in plan_split(model).layers:
        hidden = layer(hidden)
    hf_causal_lm_loss(hidden, input_ids).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_encoder_decoder_is_refused():
    import transformers
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    with pytest.raises(ModelSplitError, match="not a decoder-only causal LM"):
        plan_split(model)


def test_model_without_a_block_list_is_refused():
    model = tiny_model("llama")
    model.model.layers = nn.Sequential(*model.model.layers)  # no longer a ModuleList
    with pytest.raises(ModelSplitError, match="exactly one nn.ModuleList"):
        plan_split(model)


def test_layerdrop_is_refused():
    from transformers import AutoModelForCausalLM
    config = tiny_config("opt")
    config.layerdrop = 0.1
    with pytest.raises(ModelSplitError, match="layerdrop=0.1"):
        plan_split(AutoModelForCausalLM.from_config(config))
