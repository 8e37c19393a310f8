"""The Hugging Face split's layers read a micro-batch's side inputs (micro_batch.py) as the model's own
forward does: a padding mask (right or left padding) and packed position ids, per family; and what the
engine refuses or returns around them."""
import pytest
import torch

from ds_greedysnake.micro_batch import LossWithMetrics, check_inputs, running_on, split_loss

pytest.importorskip("transformers")
from hf_models import FAMILIES, VOCAB, tiny_model  # noqa: E402
from ds_greedysnake.models.hf import hf_layers  # noqa: E402


def split_forward(layers, inputs):
    with torch.no_grad(), running_on(inputs):
        hidden = inputs["input_ids"]
        for layer in layers:
            hidden = layer(hidden)
    return hidden


def padded(left: bool):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, VOCAB, (3, 12), generator=generator)
    mask = torch.ones(3, 12, dtype=torch.long)
    lengths = (12, 9, 5)
    for row, length in enumerate(lengths):
        if left:
            mask[row, :12 - length] = 0
        else:
            mask[row, length:] = 0
    return {"input_ids": input_ids, "attention_mask": mask}


def packed():
    generator = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(4, VOCAB, (1, 12), generator=generator),
            "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["right_padding", "left_padding", "packed"])
def test_the_split_computes_what_the_model_computes(family, case):
    model = tiny_model(family).eval()
    inputs = {"right_padding": lambda: padded(False), "left_padding": lambda: padded(True), "packed": packed}[case]()
    with torch.no_grad():
        expected = model(**inputs, use_cache=False).logits  # use_cache=False: as Trainer and SFTTrainer call it
    got = split_forward(hf_layers(model), inputs)
    valid = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
    assert torch.allclose(got[valid], expected[valid], rtol=0, atol=1e-5), float((got - expected)[valid].abs().max())
    if case == "packed":  # the documents kept to themselves: each as if alone
        with torch.no_grad():
            alone = torch.cat([model(input_ids=inputs["input_ids"][:, start:end], use_cache=False).logits
                               for start, end in ((0, 5), (5, 9), (9, 12))], dim=1)
        if family != "opt":  # OPT's own forward lets packed documents see each other; the split does as it does
            assert torch.allclose(got, alone, rtol=0, atol=1e-5)


def test_a_side_input_no_layer_reads_is_refused():
    ids = torch.zeros(1, 4, dtype=torch.long)
    check_inputs(ids, ())
    check_inputs({"input_ids": ids, "attention_mask": ids}, ("attention_mask",))
    with pytest.raises(ValueError, match=r"\['position_ids'\].*no layer"):
        check_inputs({"input_ids": ids, "position_ids": ids}, ("attention_mask",))
    with pytest.raises(ValueError, match="input_ids"):
        check_inputs({"attention_mask": ids}, ("attention_mask",))


def test_metrics_must_be_one_element_tensors():
    loss = torch.tensor(1.0)
    assert split_loss(loss) == (loss, {})
    got, metrics = split_loss(LossWithMetrics(loss, {"count": torch.tensor(3)}))
    assert got is loss and metrics == {"count": torch.tensor(3)}
    with pytest.raises(ValueError, match="'per_token'"):
        split_loss(LossWithMetrics(loss, {"per_token": torch.ones(3)}))
