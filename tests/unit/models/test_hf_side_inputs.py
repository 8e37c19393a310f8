"""The Hugging Face split's layers read a micro-batch's side inputs (micro_batch.py) as the model's own
forward does: a padding mask (right or left padding) and packed position ids, per family; and what the
engine refuses or returns around them."""
import pytest
import torch

from ds_greedysnake.models.micro_batch import LossWithMetrics, check_inputs, running_on, split_loss

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


def full_ones_mask():
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(4, VOCAB, (2, 12), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones(2, 12, dtype=torch.long)}


def unpacked_positions():
    generator = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(4, VOCAB, (2, 12), generator=generator),
            "position_ids": torch.arange(12).unsqueeze(0).expand(2, -1)}


BLOCK_CASES = {"none": lambda: {"input_ids": torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))},
               "full_ones_mask": full_ones_mask, "unpacked_positions": unpacked_positions,
               "right_padding": lambda: padded(False), "packed": packed}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_blocks_read_no_device_value_where_the_host_copies_answer(family, case, monkeypatch):
    """On a GPU every read of a device value makes the host wait for the device's queued work. transformers'
    mask code reads one per call (packed positions? padding all ones?); the split's blocks answer those from
    the micro-batch's host tensors (micro_batch.DeviceInputs), so a block reads none where the mask is the
    plain causal one, and the same mask comes out, bitwise, as when transformers decides on the device."""
    from transformers import masking_utils
    from ds_greedysnake.models.micro_batch import DeviceInputs
    if family not in FAMILIES:
        pytest.skip(f"{family} not among the test families")
    model = tiny_model(family).eval()
    inputs = BLOCK_CASES[case]()
    layers = hf_layers(model)
    reads = []
    for name in ("find_packed_sequence_indices", "fast_all"):
        original = getattr(masking_utils, name)
        monkeypatch.setattr(masking_utils, name, lambda *args, _original=original, _name=name, **kwargs:
                            reads.append(_name) or _original(*args, **kwargs))

    def blocks_output(batch):
        with torch.no_grad(), running_on(batch):
            hidden = layers[0](batch["input_ids"])
            reads.clear()  # the input layer runs the model's own forward: its one mask per micro-batch
            for layer in layers[1:-1]:
                hidden = layer(hidden)
        return hidden, list(reads)

    # As copied to the device by the engine (the host tensors kept), and with no host copies to decide from.
    with_host, host_reads = blocks_output(DeviceInputs(dict(inputs), inputs))
    without_host, device_reads = blocks_output(DeviceInputs(dict(inputs), {}))
    assert torch.equal(with_host, without_host)
    mask_reads_positions = layers[1]._mask_reads_positions  # learned from the family's stack (OPT: no)
    if case == "right_padding" or case == "packed":
        # A real padding mask, real packing: transformers builds that mask, reading as it does (docs/cuda.md).
        assert host_reads == device_reads
        assert bool(device_reads) == (case == "right_padding" or mask_reads_positions)
    else:
        assert host_reads == [], host_reads
        if case == "full_ones_mask" or (case == "unpacked_positions" and mask_reads_positions):
            assert device_reads, "transformers read nothing: the test no longer sees the reads it counts"
