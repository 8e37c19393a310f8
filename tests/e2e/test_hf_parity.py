"""Hugging Face models under greedysnake: 3 steps equal plain PyTorch (fp32), tied embeddings included;
dropout draws the same masks in forward and in the backward recompute."""
import os

import pytest
import torch

pytest.importorskip("transformers")

import ds_greedysnake  # noqa: E402
from ds_greedysnake.models.hf import hf_causal_lm_loss  # noqa: E402
from hf_models import FAMILIES, hf_data, hf_loss_of, tiny_model  # noqa: E402
from helpers import ds_config, reference_training, relative_l2  # noqa: E402

pytestmark = pytest.mark.slow

NUM_MICRO_BATCHES = 3
STEPS = 3
FP32_TOLERANCE = 1e-5


def train_greedysnake(nvme_path, family, steps, seed=0, clipping=0.0, model_options=None, **greedysnake):
    os.makedirs(nvme_path, exist_ok=True)
    model = tiny_model(family, seed=seed, **(model_options or {}))
    config = ds_config(nvme_path, NUM_MICRO_BATCHES, clipping=clipping, greedysnake=greedysnake)
    engine, _, _, _ = ds_greedysnake.initialize(model=model, config=config, loss_fn=hf_causal_lm_loss)
    batches = hf_data()
    losses, grad_norms = [], []
    for _ in range(steps):
        losses.append(float(engine.train_batch(batches)))
        grad_norms.append(engine.last_step_metrics.global_grad_norm)
    return engine, losses, batches, grad_norms


CASES = [(family, True, 0.0) for family in FAMILIES] + [("gpt2", False, 0.0), ("opt", False, 0.0), ("llama", True, 1.0)]


@pytest.mark.parametrize("family,overlap,clipping", CASES)
def test_hf_family_matches_pytorch(tmp_path, family, overlap, clipping):
    engine, losses, batches, grad_norms = train_greedysnake(str(tmp_path), family, STEPS, clipping=clipping,
                                                optimizer_overlap=overlap)
    reference, reference_losses = reference_training(tiny_model(family), None, NUM_MICRO_BATCHES, STEPS, clipping,
                                                     batches=hf_data(), loss_of=hf_loss_of)
    masters = engine.master_parameters()
    assert set(masters) == {name for name, _ in reference.named_parameters()}  # a tied weight counted once
    assert losses == pytest.approx(reference_losses, rel=FP32_TOLERANCE)
    assert relative_l2(masters, reference) <= FP32_TOLERANCE
    assert relative_l2(masters, tiny_model(family)) > 100 * FP32_TOLERANCE  # the weights moved
    if clipping:
        assert max(grad_norms) > clipping  # clipping really scaled the gradients
    if family in ("gpt2", "opt"):
        assert engine.layers[-1].lenders == [engine.layers[0]]
        # Forward-only loss after training sees the updated tied weight through the head.
        reference_batches = hf_data()
        for _ in range(STEPS * NUM_MICRO_BATCHES):
            next(reference_batches)
        with torch.no_grad():
            expected = sum(float(hf_loss_of(reference, *next(reference_batches)))
                           for _ in range(NUM_MICRO_BATCHES)) / NUM_MICRO_BATCHES
        assert float(engine.eval_batch(batches)) == pytest.approx(expected, rel=FP32_TOLERANCE)
    engine.close()


def test_dropout_runs_are_reproducible(tmp_path):
    torch.manual_seed(123)
    first = train_greedysnake(str(tmp_path / "a"), "gpt2", 2, model_options={"dropout": 0.1})
    torch.manual_seed(123)
    second = train_greedysnake(str(tmp_path / "b"), "gpt2", 2, model_options={"dropout": 0.1})
    assert first[1] == second[1]
    for name, value in first[0].master_parameters().items():
        assert torch.equal(value, second[0].master_parameters()[name]), name
    no_dropout = train_greedysnake(str(tmp_path / "c"), "gpt2", 2)
    assert first[1] != no_dropout[1]  # dropout was really on
    for run in (first, second, no_dropout):
        run[0].close()


def test_recompute_replays_the_forward_dropout_masks(tmp_path):
    """Every block's backward recompute returns exactly what its forward returned for the same input."""
    model = tiny_model("gpt2", dropout=0.1)
    calls = []
    for block in model.transformer.h:
        block.register_forward_hook(lambda module, args, output: calls.append(
            (module, args[0].detach().clone(), output.detach().clone(), torch.is_grad_enabled())))
    engine, _, _, _ = ds_greedysnake.initialize(model=model, config=ds_config(str(tmp_path), NUM_MICRO_BATCHES),
                                                loss_fn=hf_causal_lm_loss)
    engine.train_batch(hf_data())
    forwards = [call for call in calls if not call[3]]
    recomputes = [call for call in calls if call[3]]
    # Block 0 (layer 1) runs forward and recompute; block 1 (layer 2) precedes the head (layer 3).
    assert len(forwards) == 2 * NUM_MICRO_BATCHES and len(recomputes) == 2 * NUM_MICRO_BATCHES
    for module, inputs, output, _ in recomputes:
        match = [f for f in forwards if f[0] is module and torch.equal(f[1], inputs)]
        assert len(match) == 1
        assert torch.equal(match[0][2], output)
    engine.close()


def test_tied_model_checkpoint_resumes_exactly(tmp_path):
    """The tied weight is saved once (with layer 0) and a resumed run continues exactly."""
    engine, _, batches, _ = train_greedysnake(str(tmp_path / "a"), "gpt2", 2)
    engine.save_checkpoint(str(tmp_path / "checkpoints"))
    uninterrupted = float(engine.train_batch(batches))
    expected = engine.master_parameters()
    engine.close()
    resumed, _, _, _ = train_greedysnake(str(tmp_path / "b"), "gpt2", 0)
    resumed.load_checkpoint(str(tmp_path / "checkpoints"))
    later = hf_data()
    for _ in range(2 * NUM_MICRO_BATCHES):
        next(later)
    assert float(resumed.train_batch(later)) == uninterrupted
    for name, value in resumed.master_parameters().items():
        assert torch.equal(value, expected[name]), name
    resumed.close()
