"""A decoder block whose forward needs an input the split does not build is refused at split time,
naming the model and the input; an input the model says how to build (BLOOM's ALiBi) is built."""
import pytest
import torch

pytest.importorskip("transformers")

from hf_models import SEQ_LEN, VOCAB  # noqa: E402
from ds_greedysnake.models.model_split import ModelSplitError, plan_split  # noqa: E402


def _tiny(config):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().eval()


def test_a_block_input_the_stack_computes_and_does_not_expose_is_refused():
    import transformers
    # Falcon with ALiBi builds the biases with a module-level function inside its forward.
    model = _tiny(transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, alibi=True, new_decoder_architecture=False,
                                            multi_query=False, parallel_attn=False, bias=True))
    with pytest.raises(ModelSplitError, match="FalconForCausalLM.*'alibi'"):
        plan_split(model)


def test_a_required_input_the_stack_passes_as_none_is_replayed():
    import transformers
    # Falcon with rotary embeddings passes alibi=None, an argument its block requires.
    model = _tiny(transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, alibi=False))
    _compose_equals_model(model)


def test_bloom_alibi_is_built_from_the_stack_method():
    import transformers
    model = _tiny(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4))
    _compose_equals_model(model)


def _compose_equals_model(model):
    layers = plan_split(model).layers
    input_ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
        hidden = input_ids
        for layer in layers:
            hidden = layer(hidden)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-6)
