"""GreedySnakeTrainer: HF Trainer with a ZeRO-Infinity config, switched by one import and the block.

Each run is a fresh process (tests/e2e/trainer_driver.py), as a user's script would be: Trainer,
accelerate and DeepSpeed keep process-wide state. A tiny Llama (fp32, random init, saved and loaded
with from_pretrained), labels about a third -100, batch 2, accumulation 3, 16 samples: an epoch of
8 micro-batches is windows of 3, 3 and 2.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import free_port, run_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_driver.py")
BIN = os.path.dirname(sys.executable)
FP32_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hf_models import tiny_model
    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(str(folder))
    return str(folder)


def run(tmp_path, name: str, mode: str, model: str, launcher: str = "python", world_size: int = 1, extra=()):
    """One Trainer job; rank 0's results. ``launcher``: python (one process), deepspeed or accelerate."""
    port = free_port()
    nvme, out = tmp_path / f"{name}_nvme", tmp_path / f"{name}.pt"
    nvme.mkdir(exist_ok=True)
    driver_args = ["--mode", mode, "--model", model, "--nvme", str(nvme), "--out", str(out),
                   "--output-dir", str(tmp_path / f"{name}_output"), *extra]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                           "LOCAL_SIZE")}
    env.update(MASTER_PORT=port, MASTER_ADDR="127.0.0.1", HF_HUB_OFFLINE="1")
    if launcher == "python":
        command = [sys.executable, DRIVER, *driver_args]
    elif launcher == "deepspeed":
        env["LOCAL_SIZE"] = str(world_size)  # the CPU accelerator's "device" count, for the launcher
        command = [os.path.join(BIN, "deepspeed"), "--num_gpus", str(world_size), "--master_port", port, DRIVER,
                   *driver_args]
    else:
        config = tmp_path / f"{name}_ds_config.json"
        subprocess.run([sys.executable, DRIVER, *driver_args, "--write-config", str(config)], check=True, env=env)
        command = [os.path.join(BIN, "accelerate"), "launch", "--num_processes", str(world_size), "--num_machines",
                   "1", "--use_deepspeed", "--deepspeed_config_file", str(config), "--main_process_port", port,
                   DRIVER, *driver_args, "--config-from-launcher"]
    run_job(name, command, env, port)
    return torch.load(str(out), weights_only=False)


def step_logs(result):
    """Trainer's per-step log entries (loss, grad_norm, learning_rate), in order."""
    return [entry for entry in result["log_history"] if "loss" in entry and "train_loss" not in entry]


def train_metrics(result):
    return next(entry for entry in result["log_history"] if "train_loss" in entry)


def max_relative_difference(first, second):
    assert set(first) == set(second)
    return max(float((first[name].float() - second[name].float()).norm() / second[name].float().norm())
               for name in second)


def expected_eval_loss(weights, world_size: int) -> float:
    """Trainer's eval_loss for the driver's 4 eval samples in batches of 2, from plain HF forwards: the
    mean of the two batches' token means on one rank; with one batch per rank on two ranks, the token
    mean over both (Trainer sums the token count over ranks)."""
    from hf_models import tiny_model
    from trainer_driver import BATCH, dataset
    model = tiny_model("llama")
    assert not model.load_state_dict(weights, strict=False).unexpected_keys
    samples = dataset(4, 1)
    sums, counts = [], []
    with torch.no_grad():
        for start in range(0, len(samples), BATCH):
            input_ids = torch.stack([sample["input_ids"] for sample in samples[start:start + BATCH]])
            labels = torch.stack([sample["labels"] for sample in samples[start:start + BATCH]])
            count = labels[:, 1:].ne(-100).sum()
            sums.append(float(model(input_ids=input_ids, labels=labels, num_items_in_batch=count).loss) * int(count))
            counts.append(int(count))
    if world_size == 1:
        return sum(total / count for total, count in zip(sums, counts)) / len(sums)
    assert world_size == len(sums)
    return sum(sums) / sum(counts)


def assert_same_run(got, expected, learning_rate=True, eval_loss=True):
    got_steps, expected_steps = step_logs(got), step_logs(expected)
    assert [entry["step"] for entry in got_steps] == [entry["step"] for entry in expected_steps]
    for mine, theirs in zip(got_steps, expected_steps):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=FP32_TOLERANCE), mine["step"]
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=FP32_TOLERANCE), mine["step"]
        if learning_rate:
            assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"], rel=1e-12, abs=1e-15), mine["step"]
    assert got["train_loss"] == pytest.approx(expected["train_loss"], rel=FP32_TOLERANCE)
    if eval_loss:
        assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=FP32_TOLERANCE)
    assert max_relative_difference(got["weights"], expected["weights"]) <= FP32_TOLERANCE


def test_matches_plain_trainer(tmp_path, model_dir):
    """Must-show 1: every logged loss, grad_norm and learning rate, train_loss, eval_loss and the
    final weights equal plain Trainer's without DeepSpeed (token-mean loss over labels with -100, a
    short last window, linear warm-up, max_grad_norm 1.0)."""
    plain = run(tmp_path, "plain", "plain", model_dir)
    greedysnake = run(tmp_path, "greedysnake", "greedysnake", model_dir)
    assert plain["engine"] == "LlamaForCausalLM" and greedysnake["engine"] == "GreedySnakeEngine"
    assert greedysnake["global_step"] == 3  # windows of 3, 3 and 2 micro-batches
    assert_same_run(greedysnake, plain)
    assert train_metrics(greedysnake)["total_flos"] == train_metrics(plain)["total_flos"] > 0
    assert greedysnake["eval_loss"] == pytest.approx(expected_eval_loss(greedysnake["weights"], 1), rel=FP32_TOLERANCE)
    steps = step_logs(plain)
    assert steps[0]["learning_rate"] == 0.0 and steps[1]["learning_rate"] > 0  # the warm-up
    assert max(entry["grad_norm"] for entry in steps) > 1.0  # clipping at 1.0 changed the update
    from hf_models import tiny_model
    initial = {name: param.detach() for name, param in tiny_model("llama").named_parameters()}
    assert max_relative_difference(greedysnake["weights"], initial) > 100 * FP32_TOLERANCE  # trained


def test_resume_from_trainer_checkpoint_in_a_new_process(tmp_path, model_dir):
    """Must-show 2: two epochs (6 steps) saving every 2 steps, at most 2 checkpoints kept; a new process
    resuming from checkpoint-4 (mid-epoch) logs the same steps 5 and 6 and ends with the same weights."""
    options = ["--epochs", "2", "--save-steps", "2", "--save-total-limit", "2"]
    whole = run(tmp_path, "whole", "greedysnake", model_dir, extra=options)
    checkpoints = tmp_path / "whole_output"
    assert sorted(os.listdir(checkpoints)) == ["checkpoint-4", "checkpoint-6"]  # save_total_limit
    assert "global_step4" in os.listdir(checkpoints / "checkpoint-4")  # the engine's checkpoint
    saved = tmp_path / "saved_checkpoint-4"
    shutil.copytree(checkpoints / "checkpoint-4", saved)
    resumed = run(tmp_path, "resumed", "greedysnake", model_dir, extra=options + ["--resume", str(saved)])
    assert resumed["global_step"] == 6
    whole_steps = {entry["step"]: entry for entry in step_logs(whole)}
    for entry in step_logs(resumed):
        assert entry["loss"] == whole_steps[entry["step"]]["loss"], entry["step"]
        assert entry["grad_norm"] == whole_steps[entry["step"]]["grad_norm"], entry["step"]
    assert [entry["step"] for entry in step_logs(resumed)][-2:] == [5, 6]
    for name, value in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
    assert resumed["eval_loss"] == whole["eval_loss"]


def test_save_model_reloads_and_the_block_off_runs_zero_infinity(tmp_path, model_dir):
    """Must-show 3: save_model's folder loads with from_pretrained and holds the engine's weights; the
    same script with the block off trains on DeepSpeed's own ZeRO-Infinity engine, and the A/B agrees."""
    from transformers import AutoModelForCausalLM
    greedysnake = run(tmp_path, "greedysnake", "greedysnake", model_dir,
                      extra=["--save-model", str(tmp_path / "saved")])
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32)
    reloaded_weights = {name: param.detach() for name, param in reloaded.named_parameters()}
    assert set(reloaded_weights) == set(greedysnake["weights"])
    for name, value in greedysnake["weights"].items():
        assert torch.equal(reloaded_weights[name], value), name
    zero_infinity = run(tmp_path, "zero_infinity", "zero_infinity", model_dir,
                        extra=["--save-model", str(tmp_path / "saved_zi")])
    assert zero_infinity["engine"] == "DeepSpeedEngine"
    # Under DeepSpeed, Trainer logs the learning rate after the engine's scheduler stepped (the next
    # step's); greedysnake logs the rate the step used, as plain Trainer does.
    assert_same_run(greedysnake, zero_infinity, learning_rate=False)
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved_zi")) is not None


def test_lora_matches_plain_trainer_and_save_model_writes_the_adapters(tmp_path, model_dir):
    """A PEFT LoRA model (base frozen) under GreedySnakeTrainer logs and trains as under plain Trainer, and
    save_model writes what PEFT writes: the adapters, which load onto the base with PeftModel."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    plain = run(tmp_path, "plain_lora", "plain", model_dir, extra=["--lora"])
    greedysnake = run(tmp_path, "lora", "greedysnake", model_dir,
                      extra=["--lora", "--save-model", str(tmp_path / "adapter")])
    assert_same_run(greedysnake, plain)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(tmp_path / "adapter"))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                       str(tmp_path / "adapter"))
    for name, param in loaded.named_parameters():
        assert torch.equal(param.detach(), greedysnake["weights"][name]), name  # adapters and base, as trained
    lora_b = [value for name, value in greedysnake["weights"].items() if "lora_B" in name]
    assert lora_b and all(float(value.abs().max()) > 0 for value in lora_b)  # PEFT starts B at zero: trained


def test_two_ranks_under_the_launchers_match_one_rank(tmp_path, model_dir):
    """Must-show 4: 2 ranks with accumulation 3, under `deepspeed --num_gpus 2` and under
    `accelerate launch` with a DeepSpeed config, equal 1 rank with accumulation 6 (24 samples: 2 steps;
    the token count of each window is summed over both ranks). Trainer's eval_loss means something else
    on two ranks (a token mean over both ranks' batches), so each is checked against its own meaning."""
    options = ["--samples", "24"]
    one = run(tmp_path, "one", "greedysnake", model_dir, extra=options + ["--gas", "6"])
    by_deepspeed = run(tmp_path, "deepspeed", "greedysnake", model_dir, "deepspeed", 2, options + ["--gas", "3"])
    by_accelerate = run(tmp_path, "accelerate", "greedysnake", model_dir, "accelerate", 2, options + ["--gas", "3"])
    assert one["world_size"] == 1 and by_deepspeed["world_size"] == 2 and by_accelerate["world_size"] == 2
    for two in (by_deepspeed, by_accelerate):
        assert two["engine"] == "GreedySnakeEngine" and two["global_step"] == 2
        assert_same_run(two, one, eval_loss=False)
        assert two["eval_loss"] == pytest.approx(expected_eval_loss(two["weights"], 2), rel=FP32_TOLERANCE)
    assert one["eval_loss"] == pytest.approx(expected_eval_loss(one["weights"], 1), rel=FP32_TOLERANCE)


def test_train_refuses_what_it_cannot_train(tmp_path, model_dir):
    """A custom compute_loss, label smoothing and an input the model's layers do not read are refused at
    train(), naming the option or the input, before any step."""
    messages = run(tmp_path, "refusals", "greedysnake", model_dir, extra=["--refusals"])
    assert "overrides compute_loss" in messages["compute_loss"]
    assert "label_smoothing_factor" in messages["label_smoothing_factor"]
    assert "token_type_ids" in messages["token_type_ids"]
    assert messages["token_type_ids.steps"] == 0  # the engine was built, and took no step


def test_a_checkpoint_without_the_16bit_gather_converts_with_its_own_zero_to_fp32(tmp_path, model_dir):
    """Issue 31, must-show 1 and 2: a Trainer run saved without stage3_gather_16bit_weights_on_model_save,
    torch's lr-scheduler check turned into an error (it passes: the scheduler sees the real optimizer
    step). The checkpoint folder's zero_to_fp32.py, run as DeepSpeed documents it, writes weights that
    from_pretrained loads, bitwise equal to engine.save_pretrained's; DeepSpeed's three Python functions,
    imported from ds_greedysnake, give the same tensors."""
    from transformers import AutoModelForCausalLM
    from ds_greedysnake import (convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint,
                                load_state_dict_from_zero_checkpoint)
    result = run(tmp_path, "no_gather", "greedysnake", model_dir,
                 extra=["--no-gather", "--save-steps", "3", "--save-pretrained", str(tmp_path / "pretrained"),
                        "--scheduler-warnings-are-errors"])
    assert result["global_step"] == 3
    checkpoint = tmp_path / "no_gather_output" / "checkpoint-3"
    files = os.listdir(checkpoint)
    assert "zero_to_fp32.py" in files and "global_step3" in files
    assert not [name for name in files if name.startswith(("model", "pytorch_model"))]  # no 16-bit weights saved
    out = tmp_path / "converted"
    done = subprocess.run([sys.executable, str(checkpoint / "global_step3" / ".." / "zero_to_fp32.py"), str(checkpoint),
                           str(out), "--safe_serialization"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert os.listdir(out) == ["model.safetensors"]
    shutil.copy(checkpoint / "config.json" if (checkpoint / "config.json").exists() else
                os.path.join(model_dir, "config.json"), out / "config.json")
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "pretrained"), dtype=torch.float32).state_dict()
    assert set(converted) == set(saved)
    for key, value in saved.items():
        assert torch.equal(converted[key], value), key
    for name, value in result["weights"].items():  # the engine's fp32 masters, as trained
        assert torch.equal(converted[name], value), name
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(tmp_path / "bin"), tag="global_step3")
    from_bin = torch.load(str(tmp_path / "bin" / "pytorch_model.bin"), weights_only=True)
    loaded = load_state_dict_from_zero_checkpoint(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                                  str(checkpoint)).state_dict()
    assert set(state_dict) == set(from_bin) == set(result["weights"])
    for key, value in state_dict.items():
        assert torch.equal(value, saved[key]) and torch.equal(from_bin[key], saved[key]), key
        assert torch.equal(loaded[key], saved[key]), key
