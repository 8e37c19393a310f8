"""The overlapped optimizer step gives exactly the synchronous step's results."""
import os
import signal

import pytest
import torch

from ds_greedysnake.storage.checkpoint import read_full_layer
from greedysnake_run import make_engine, run_greedysnake
from helpers import data, tiny_gpt_config

pytestmark = pytest.mark.slow

WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 3}}


def assert_same(first, second):
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("num_micro_batches", [1, 4])
@pytest.mark.parametrize("clipping", [0.0, 1.0])
def test_overlap_on_and_off_are_bitwise_identical(tmp_path, num_micro_batches, clipping):
    runs = {}
    for overlap in (False, True):
        runs[overlap] = run_greedysnake(str(tmp_path / str(overlap)), num_micro_batches, 4, clipping=clipping,
                                        scheduler=WARMUP, greedysnake={"optimizer_overlap": overlap,
                                                                       "deferred_layers": 2})
    assert runs[True].losses == runs[False].losses
    assert_same(runs[True].masters, runs[False].masters)
    # The warm-up really changed the learning rate from step to step.
    assert runs[True].engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert runs[True].engine.optimizer.step_count == 4


def _train_with_overflow(nvme_path, overlap):
    """Step 2 gets an inf in layer 2's gradient: that step must be skipped for every layer."""
    run = run_greedysnake(nvme_path, 2, 1, greedysnake={"optimizer_overlap": overlap, "deferred_layers": 1})
    engine = run.engine
    after_first = engine.master_parameters()
    layer = engine.layers[2]
    original = layer.take_grads

    def poisoned():
        grads = original()
        grads[0] = float("inf")
        return grads

    layer.take_grads = poisoned
    batches = data(tiny_gpt_config())
    for _ in range(2):  # the micro-batches step 1 consumed
        next(batches)
    engine.train_batch(batches)
    assert engine.last_step_metrics.skipped
    after_skipped = engine.master_parameters()
    layer.take_grads = original
    engine.train_batch(batches)
    return engine, after_first, after_skipped, engine.master_parameters()


def test_overflow_skips_every_layer_with_overlap(tmp_path):
    engine, after_first, after_skipped, after_third = _train_with_overflow(str(tmp_path / "on"), overlap=True)
    assert_same(after_first, after_skipped)
    assert engine.skipped_steps == 1 and engine.optimizer.step_count == 2
    assert not torch.equal(after_third["1.qkv.weight"], after_first["1.qkv.weight"])
    _, _, _, synchronous_third = _train_with_overflow(str(tmp_path / "off"), overlap=False)
    assert_same(after_third, synchronous_third)


def test_checkpoint_right_after_train_batch_holds_updated_weights(tmp_path):
    overlapped, batches = make_engine(str(tmp_path / "on"), 4, greedysnake={"deferred_layers": 3})
    for _ in range(2):
        overlapped.train_batch(batches)
    # The deferred front layers' updates were submitted at the end of the step and may still run.
    assert all(layer.pending_update is not None for layer in overlapped.layers[:3])
    overlapped.save_checkpoint(str(tmp_path / "checkpoints"), tag="right_after")
    synchronous, batches = make_engine(str(tmp_path / "off"), 4, greedysnake={"optimizer_overlap": False})
    for _ in range(2):
        synchronous.train_batch(batches)
    for layer in synchronous.layers:
        saved = read_full_layer(str(tmp_path / "checkpoints"), "right_after", layer.index, layer.numel)
        assert torch.equal(saved.master, synchronous.optimizer.read_master(layer)), layer.index


def test_dead_worker_is_reported(tmp_path):
    run = run_greedysnake(str(tmp_path), 2, 1)
    engine = run.engine
    worker = engine.optimizer.updater._process
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    with pytest.raises(RuntimeError, match=f"worker \\(pid {worker.pid}\\) exited with code -9"):
        for _ in range(2):
            engine.train_batch(data(tiny_gpt_config()))


def test_deferred_layers_beyond_the_model_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"deferred_layers \(9\) exceeds the model's 5 layers"):
        make_engine(str(tmp_path), 2, greedysnake={"deferred_layers": 9})


def test_eval_right_after_train_batch_sees_updated_weights(tmp_path):
    from helpers import fresh_model, reference_training
    from ds_greedysnake.models.gpt import lm_loss

    engine, batches = make_engine(str(tmp_path), 4, greedysnake={"deferred_layers": 3})
    for _ in range(2):
        engine.train_batch(batches)
    evaluation = [next(batches) for _ in range(4)]
    loss = float(engine.eval_batch(iter(evaluation)))  # the front layers' updates are still pending here
    config = tiny_gpt_config()
    reference, _ = reference_training(fresh_model(config), config, 4, 2)
    with torch.no_grad():
        expected = sum(float(lm_loss(reference(inputs), labels)) for inputs, labels in evaluation) / 4
    assert loss == pytest.approx(expected, rel=1e-5)
    # A second evaluation is the same: evaluating changes nothing.
    assert float(engine.eval_batch(iter(evaluation))) == loss
