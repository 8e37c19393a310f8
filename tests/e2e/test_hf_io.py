"""Your model in, your model out: a Hugging Face checkpoint loaded layer by layer, trained, and given
back through every API a DeepSpeed or HF user reaches for, bitwise or within the fp32 tolerance."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import deepspeed  # noqa: E402
from safetensors import safe_open  # noqa: E402

import ds_greedysnake  # noqa: E402
from ds_greedysnake.models import export  # noqa: E402
from ds_greedysnake.models.weights import WeightsAccessError  # noqa: E402
from hf_models import hf_data, hf_loss_of, tiny_model  # noqa: E402
from helpers import ds_config, free_port, reference_training, relative_l2, remove_shm_buffers  # noqa: E402

pytestmark = pytest.mark.slow

NUM_MICRO_BATCHES = 3
STEPS = 3
FP32_TOLERANCE = 1e-5
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def file_tensors(folder):
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as handle:
                tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return dict(sorted(tensors.items()))


def pretrained_engine(tmp_path, family, **config_options):
    """A tiny HF model saved by HF, and a greedysnake engine started from that folder."""
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "pretrained", max_shard_size="100KB")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    engine, _, _, _ = ds_greedysnake.from_pretrained(tmp_path / "pretrained",
                                                     config=ds_config(str(nvme), NUM_MICRO_BATCHES, **config_options))
    return model, engine


def assert_same(got, expected, dtype=None):
    assert list(got) == list(expected)
    for key, value in expected.items():
        value = value if dtype is None else value.to(dtype)
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pretrained_in_and_every_way_out_is_bitwise(tmp_path, family):
    from transformers import AutoModelForCausalLM
    model, engine = pretrained_engine(tmp_path, family)
    original = model.state_dict()
    assert all(param.numel() == 0 for param in engine.module.parameters())  # the weights live on SSD

    assert engine.save_16bit_model(str(tmp_path / "16bit")) is True
    assert_same(torch.load(tmp_path / "16bit" / "pytorch_model.bin"), original)
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    assert_same(consolidated, original)
    state = engine.module.state_dict()
    assert_same(state, original)
    if family == "gpt2":
        assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()  # as torch's
    block = "transformer.h.1" if family == "gpt2" else "model.layers.1"
    assert_same(engine.module.get_submodule(block).state_dict(),
                {key[len(block) + 1:]: value for key, value in original.items() if key.startswith(block + ".")})
    if family == "gpt2":
        assert consolidated["lm_head.weight"] is consolidated["transformer.wte.weight"]  # tied: one tensor

    with deepspeed.zero.GatheredParameters(engine.module.parameters()):
        for name, param in engine.module.named_parameters():
            assert torch.equal(param.detach().cpu(), original[name]), name
    assert all(param.numel() == 0 for param in engine.module.parameters())  # placeholders back
    first = next(engine.module.parameters())
    with pytest.raises(WeightsAccessError, match="changed inside deepspeed.zero.GatheredParameters"):
        with deepspeed.zero.GatheredParameters([first], modifier_rank=0):
            first.data.add_(1.0)
    assert_same(engine.module.state_dict(), original)  # not written back
    with pytest.raises(WeightsAccessError, match="pretrained=dir"):
        engine.module.load_state_dict(original)

    engine.save_pretrained(str(tmp_path / "out"), max_shard_size="100KB")
    assert_same(file_tensors(tmp_path / "out"), file_tensors(tmp_path / "pretrained"))
    engine.module.save_pretrained(tmp_path / "out_hf")  # HF's own method, through module.state_dict()
    for folder in ("out", "out_hf"):
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        assert_same(reloaded.state_dict(), original)
    engine.close()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_trained_weights_out_equal_pytorch_and_reload(tmp_path, family):
    """3 steps from the pretrained weights equal plain PyTorch AdamW from the same model; the export
    reloads in HF with exactly the engine's weights and the engine's loss; the CLI export of a saved
    checkpoint writes the same tensors."""
    from transformers import AutoModelForCausalLM
    _, engine = pretrained_engine(tmp_path, family)
    engine.module.state_dict()  # reading the weights out before training changes nothing
    with deepspeed.zero.GatheredParameters(engine.module.parameters()):
        pass
    assert engine.get_global_grad_norm() is None  # no step yet, as DeepSpeed
    batches = hf_data()
    norms = []
    for _ in range(STEPS):
        engine.train_batch(batches)
        norms.append(engine.get_global_grad_norm())
        assert norms[-1] == engine.last_step_metrics.global_grad_norm and norms[-1] > 0
    reference, _ = reference_training(tiny_model(family), None, NUM_MICRO_BATCHES, STEPS,
                                      batches=hf_data(), loss_of=hf_loss_of)

    engine.save_pretrained(str(tmp_path / "out"), max_shard_size="200KB")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    weights = {name: param.detach() for name, param in reloaded.named_parameters()}
    assert relative_l2(weights, reference) <= FP32_TOLERANCE
    assert relative_l2(weights, tiny_model(family)) > 100 * FP32_TOLERANCE  # trained
    masters = engine.master_parameters()
    assert set(masters) == set(weights)
    for name, value in masters.items():
        assert torch.equal(weights[name], value), name
    # The same loss from the reloaded model as from the engine, on the next micro-batches.
    later = hf_data()
    for _ in range(STEPS * NUM_MICRO_BATCHES):
        next(later)
    with torch.no_grad():
        expected = sum(float(hf_loss_of(reloaded, *next(later))) for _ in range(NUM_MICRO_BATCHES)) / NUM_MICRO_BATCHES
    assert float(engine.eval_batch(batches)) == pytest.approx(expected, rel=1e-6)

    engine.save_checkpoint(str(tmp_path / "checkpoints"), tag="trained")
    assert export.main(["--checkpoint", str(tmp_path / "checkpoints"), "--tag", "trained", "--model-config",
                        str(tmp_path / "pretrained"), "--out", str(tmp_path / "cli")]) == 0
    assert_same(file_tensors(tmp_path / "cli"), file_tensors(tmp_path / "out"))
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["architectures"] == [type(reloaded).__name__]
    engine.close()


def test_bf16_weights_out_are_the_compute_weights(tmp_path):
    """Under bf16 the 16-bit exports are bf16 (the weights the model computes with), save_pretrained
    writes bf16 with a bf16 config, and dtype=float32 gives the fp32 master weights."""
    model, engine = pretrained_engine(tmp_path, "gpt2", bf16=True)
    original = model.state_dict()
    assert engine.save_16bit_model(str(tmp_path / "16bit"), "weights.pt")
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    saved = torch.load(tmp_path / "16bit" / "weights.pt")
    assert_same({k: v for k, v in saved.items() if k in params}, {k: v for k, v in original.items() if k in params},
                torch.bfloat16)
    engine.train_batch(hf_data())
    masters = engine.master_parameters()
    engine.save_pretrained(str(tmp_path / "bf16"))
    engine.save_pretrained(str(tmp_path / "fp32"), dtype=torch.float32)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    bf16, fp32 = file_tensors(tmp_path / "bf16"), file_tensors(tmp_path / "fp32")
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    for name, value in masters.items():
        assert torch.equal(fp32[name], value) and torch.equal(bf16[name], value.to(torch.bfloat16)), name
        assert torch.equal(consolidated[name], bf16[name]), name
    engine.close()


def test_two_ranks_export_the_gathered_weights(tmp_path):
    """On 2 ranks every export gathers each layer's shards (each rank calls it, rank 0 writes);
    engine.module.state_dict() on one rank could only hang, so it raises naming those calls."""
    from test_data_parallel import launch
    from transformers import AutoModelForCausalLM
    out = tmp_path / "export"
    result = launch(tmp_path, 2, 2, 1, "export", extra=["--hf-family", "gpt2", "--export", str(out)])
    masters = result["masters"]
    assert "2 ranks" in result["state_dict_error"] and "save_pretrained" in result["state_dict_error"]
    for name, value in masters.items():
        assert torch.equal(result["gathered"][name], value), name
    saved = torch.load(out / "pytorch_model.bin")
    assert saved["lm_head.weight"] is saved["transformer.wte.weight"]
    reloaded = AutoModelForCausalLM.from_pretrained(out / "hf")
    for name, param in reloaded.named_parameters():
        assert torch.equal(param.detach(), masters[name]) and torch.equal(saved[name], masters[name]), name


def test_train_hf_starts_from_the_pretrained_folder_and_saves(tmp_path):
    from transformers import AutoModelForCausalLM
    model = tiny_model("gpt2", seed=5)  # not what the script's own seeded initialisation would give
    model.save_pretrained(tmp_path / "pretrained")
    port = free_port()
    command = [sys.executable, os.path.join(REPO, "scripts", "train_hf.py"), "--config-path",
               str(tmp_path / "pretrained"), "--seq-len", "32", "--micro-batches", "2", "--steps", "1", "--fp32",
               "--nvme-path", str(tmp_path / "nvme"), "--save-pretrained", str(tmp_path / "out")]
    try:
        done = subprocess.run(command, env=dict(os.environ, MASTER_PORT=port, HF_HUB_OFFLINE="1"),
                              capture_output=True, text=True, timeout=300)
    finally:
        remove_shm_buffers(port)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    distance = relative_l2({name: param.detach() for name, param in trained.named_parameters()}, model)
    # One step of lr 3e-4 from the pretrained weights: moved, but nowhere near a fresh initialisation.
    assert 0 < distance < 0.05, distance
