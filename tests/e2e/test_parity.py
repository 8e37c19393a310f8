"""Exactness: greedysnake's parameters after several steps equal plain PyTorch AdamW with accumulation."""
import os

import pytest
import torch

from ds_greedysnake.runtime import optimizer as optimizer_module
from ds_greedysnake.runtime.schedule import default_deferred_layers
from greedysnake_run import make_engine, run_greedysnake
from helpers import fresh_model, reference_training, relative_l2, tiny_gpt_config

pytestmark = pytest.mark.slow

NUM_MICRO_BATCHES = 4
STEPS = 3
FP32_TOLERANCE = 1e-5
# bf16 weights and activations against an fp32 reference: bf16 keeps 8 bits of mantissa, so every
# forward and backward differs by ~0.4% per operation. After 3 steps (M=4, lr 1e-3) the fp32 masters
# were 1.7e-3 relative L2 from the fp32 reference when measured (docs/parity.md), and a step that did
# nothing would be 1.0e-2 away; the bound sits between.
BF16_TOLERANCE = 5e-3


@pytest.mark.parametrize("clipping", [0.0, 1.0])
def test_fp32_matches_pytorch(tmp_path, clipping):
    run = run_greedysnake(str(tmp_path), NUM_MICRO_BATCHES, STEPS, clipping=clipping)
    config = tiny_gpt_config()
    reference, reference_losses = reference_training(fresh_model(config), config, NUM_MICRO_BATCHES, STEPS, clipping)
    assert relative_l2(run.masters, reference) <= FP32_TOLERANCE
    assert run.losses == pytest.approx(reference_losses, rel=1e-5)
    if clipping:
        # The test must exercise clipping: the global norm exceeds the threshold.
        assert max(m.global_grad_norm for m in run.metrics) > clipping
    # And the weights moved: a step that did nothing would also be "close".
    assert relative_l2(run.masters, fresh_model(config)) > 100 * FP32_TOLERANCE


def test_bf16_within_documented_tolerance(tmp_path):
    run = run_greedysnake(str(tmp_path), NUM_MICRO_BATCHES, STEPS, bf16=True)
    config = tiny_gpt_config()
    reference, reference_losses = reference_training(fresh_model(config), config, NUM_MICRO_BATCHES, STEPS)
    assert relative_l2(run.masters, reference) <= BF16_TOLERANCE
    assert run.losses == pytest.approx(reference_losses, rel=2e-2)
    assert all(m.dtype == torch.float32 for m in run.masters.values())


def test_spilling_and_prefetch_change_nothing(tmp_path):
    baseline = run_greedysnake(str(tmp_path / "a"), NUM_MICRO_BATCHES, 2)
    spilled = run_greedysnake(str(tmp_path / "b"), NUM_MICRO_BATCHES, 2,
                              greedysnake={"activation_host_memory_mb": 0, "prefetch": False})
    assert spilled.metrics[-1].ssd_bytes_written.get("activation", 0) > 0
    for name, value in baseline.masters.items():
        assert torch.equal(value, spilled.masters[name]), name
    assert baseline.losses == spilled.losses


def test_deeper_prefetch_changes_nothing(tmp_path):
    """Two or three parameter reads in flight (prefetch_depth), each on its own aio handle, some of them
    skipped while the layer's update still runs (the overlap): the same bits, the same parameter bytes
    read per step."""
    runs = {depth: run_greedysnake(str(tmp_path / str(depth)), NUM_MICRO_BATCHES, 2,
                                   greedysnake={"prefetch_depth": depth})
            for depth in (1, 2, 3)}
    for depth in (2, 3):
        for name, value in runs[1].masters.items():
            assert torch.equal(value, runs[depth].masters[name]), (depth, name)
        assert runs[depth].losses == runs[1].losses
        assert runs[depth].metrics[-1].ssd_bytes_read["param"] == runs[1].metrics[-1].ssd_bytes_read["param"]
    for run in runs.values():
        run.engine.close()


def test_gradient_paths_change_nothing(tmp_path):
    """Gradients through shared host memory (default), through SSD, or some of each: the same bits."""
    host = run_greedysnake(str(tmp_path / "host"), NUM_MICRO_BATCHES, 2)
    head_mib = 4 * host.engine.layers[-1].shard_numel / 2**20
    assert host.engine.optimizer.host.gradients.holds(0)
    for name, budget in (("ssd", 0), ("mixed", 1.01 * head_mib + 0.01)):
        other = run_greedysnake(str(tmp_path / name), NUM_MICRO_BATCHES, 2,
                                greedysnake={"gradient_host_memory_mb": budget})
        arena = other.engine.optimizer.host.gradients
        assert [arena.holds(layer.index) for layer in other.engine.layers][-1] == (name == "mixed")
        assert not arena.holds(0)
        assert other.losses == host.losses
        for key, value in host.masters.items():
            assert torch.equal(value, other.masters[key]), (name, key)


@pytest.mark.parametrize("overlap", [True, False])
def test_optimizer_state_paths_change_nothing(tmp_path, overlap):
    """The front layers' optimizer states in shared host memory (default) or every state on SSD: the
    same bits, and less SSD traffic for the worker."""
    runs = {}
    for name, budget in (("host", 1024.0), ("ssd", 0.0)):
        runs[name] = run_greedysnake(str(tmp_path / name), NUM_MICRO_BATCHES, 2,
                                     greedysnake={"optimizer_overlap": overlap, "optimizer_host_memory_mb": budget})
    layers = runs["host"].engine.layers
    # Eligible: the layers only updated after the decision (the deferred ones, or all without overlap).
    eligible = default_deferred_layers(len(layers)) if overlap else len(layers)
    in_host = [runs["host"].engine.optimizer.states_in_host_memory(layer) for layer in layers]
    assert in_host == [index < eligible for index in range(len(layers))]
    assert not any(runs["ssd"].engine.optimizer.states_in_host_memory(layer) for layer in runs["ssd"].engine.layers)
    assert runs["host"].losses == runs["ssd"].losses
    for key, value in runs["ssd"].masters.items():
        assert torch.equal(value, runs["host"].masters[key]), key
    moved = {name: run.metrics[-1].ssd_bytes_read.get("optimizer_worker" if overlap else "optimizer", 0)
             for name, run in runs.items()}
    assert moved["host"] < moved["ssd"], moved


@pytest.mark.parametrize("overlap", [True, False])
def test_state_pieces_change_nothing(tmp_path, monkeypatch, overlap):
    """Optimizer states streamed in many pieces per layer (update_pipeline.py), with gradients and states
    through SSD and clipping on: the same bits as whole-layer pieces."""
    options = {"optimizer_overlap": overlap, "optimizer_host_memory_mb": 0, "gradient_host_memory_mb": 0}
    whole = run_greedysnake(str(tmp_path / "whole"), NUM_MICRO_BATCHES, 2, clipping=1.0, greedysnake=options)
    monkeypatch.setattr(optimizer_module, "STATE_PIECE_NUMEL", 100_000)
    pieces = run_greedysnake(str(tmp_path / "pieces"), NUM_MICRO_BATCHES, 2, clipping=1.0, greedysnake=options)
    block = pieces.engine.layers[1]
    assert block.shard_numel > 3 * 100_000, "the test needs layers of several pieces"
    assert len(pieces.engine.optimizer._state_regions[block.index][0]) == -(-block.shard_numel // 100_000)
    assert pieces.losses == whole.losses
    for key, value in whole.masters.items():
        assert torch.equal(value, pieces.masters[key]), key


def test_blocks_are_really_on_ssd(tmp_path):
    run = run_greedysnake(str(tmp_path), NUM_MICRO_BATCHES, 1)
    engine = run.engine
    block = engine.layers[1]
    assert block.region.padded_bytes > 1 << 20, "a block must exceed the 1 MiB ZeRO-3 keeps in memory"
    assert os.path.getsize(block.region.path) == block.region.padded_bytes
    assert all(p.numel() == 0 for p in block.params), "released layers hold no weights in memory"
    # Every layer in both sweeps, but the last layer (not run in forward) and layer L-2 (resident across
    # the turn) once.
    expected_param_bytes = sum(layer.region.padded_bytes for layer in engine.layers) * 2 \
        - engine.layers[-1].region.padded_bytes - engine.layers[-2].region.padded_bytes
    assert run.metrics[0].ssd_bytes_read["param"] == expected_param_bytes


def test_model_built_under_zero_init_trains_identically(tmp_path):
    import deepspeed
    import ds_greedysnake
    from ds_greedysnake.models.gpt import build_gpt, lm_loss
    from helpers import data, ds_config

    plain = run_greedysnake(str(tmp_path / "plain"), 2, 2)
    config = tiny_gpt_config()
    ds = ds_config(str(tmp_path), 2)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = build_gpt(config)
    engine, _, _, _ = ds_greedysnake.initialize(model=model, config=ds, loss_fn=lm_loss)
    batches = data(config)
    losses = [float(engine.train_batch(batches)) for _ in range(2)]
    masters = engine.master_parameters()
    # Not bitwise: zero.Init replaces torch.nn.functional.linear for the rest of the process with
    # DeepSpeed's own autograd function, which rounds differently from PyTorch's addmm.
    assert losses == pytest.approx(plain.losses, rel=1e-6)
    reference_model = fresh_model(config)
    for name, param in reference_model.named_parameters():
        param.data = plain.masters[name]
    assert relative_l2(masters, reference_model) <= 1e-6


def test_read_ahead_changes_nothing(tmp_path, monkeypatch):
    """The worker reading the next step's state pieces ahead (optimizer_read_ahead_mb), with states and
    gradients on SSD and several pieces per layer: the same bits and SSD bytes as without, and the
    pieces read ahead were used."""
    monkeypatch.setattr(optimizer_module, "STATE_PIECE_NUMEL", 100_000)
    runs = {}
    for name, budget in (("off", 0.0), ("on", 64.0)):
        runs[name] = run_greedysnake(str(tmp_path / name), NUM_MICRO_BATCHES, 3, greedysnake={
            "optimizer_overlap": True, "optimizer_host_memory_mb": 0, "gradient_host_memory_mb": 0,
            "optimizer_read_ahead_mb": budget})
    assert runs["off"].engine.optimizer.read_ahead_pieces == 0
    assert runs["on"].engine.optimizer.read_ahead_pieces > 1
    # Read ahead after step 1 and step 2, used by steps 2 and 3.
    assert runs["on"].engine.optimizer.updater.bytes_read_ahead > 0
    assert runs["off"].engine.optimizer.updater.bytes_read_ahead == 0
    assert runs["on"].losses == runs["off"].losses
    for key, value in runs["off"].masters.items():
        assert torch.equal(value, runs["on"].masters[key]), key
    # Every update is complete (master_parameters waits): the worker's bytes, read ahead or not, are the same.
    counters = {name: run.engine.optimizer.updater.counters for name, run in runs.items()}
    assert counters["on"].bytes_read == counters["off"].bytes_read
    assert counters["on"].bytes_written == counters["off"].bytes_written


def test_loading_a_checkpoint_drops_what_was_read_ahead(tmp_path):
    """A checkpoint loaded into a running engine whose worker has read state pieces ahead: they are
    dropped before the states are rewritten, and training goes on from the checkpoint exactly."""
    losses, masters = {}, {}
    for name, budget in (("off", 0.0), ("on", 64.0)):
        engine, batches = make_engine(str(tmp_path / name / "nvme"), NUM_MICRO_BATCHES, greedysnake={
            "optimizer_host_memory_mb": 0, "optimizer_read_ahead_mb": budget})
        engine.train_batch(batches)
        engine.save_checkpoint(str(tmp_path / name / "checkpoints"), tag="step1")
        engine.train_batch(batches)  # its states are read ahead after this step
        engine.load_checkpoint(str(tmp_path / name / "checkpoints"), tag="step1")
        losses[name] = [float(engine.train_batch(batches)) for _ in range(2)]
        masters[name] = engine.master_parameters()
        if budget:
            assert engine.optimizer.read_ahead_pieces > 0
        engine.close()
    assert losses["on"] == losses["off"]
    for key, value in masters["off"].items():
        assert torch.equal(value, masters["on"][key]), key


def test_gathered_parameters_over_a_zero_init_model_give_its_weights(tmp_path):
    """deepspeed.zero.GatheredParameters over the engine's module, built under zero.Init (whose own
    partitions greedysnake dropped), gives greedysnake's current weights, as state_dict() does."""
    import deepspeed
    import ds_greedysnake
    from ds_greedysnake.models.gpt import build_gpt, lm_loss
    from helpers import data, ds_config

    config = tiny_gpt_config()
    ds = ds_config(str(tmp_path), 2)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = build_gpt(config)
    engine, _, _, _ = ds_greedysnake.initialize(model=model, config=ds, loss_fn=lm_loss)
    engine.train_batch(data(config))
    masters = engine.master_parameters()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for name, param in engine.module.named_parameters():
            assert torch.equal(param.detach().cpu(), masters[name]), name
    state = engine.module.state_dict()
    for name, value in masters.items():
        assert torch.equal(state[name], value), name
    engine.close()
