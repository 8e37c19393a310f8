"""GreedySnakeSFTTrainer: TRL's SFTTrainer switched by one import, against plain SFTTrainer (no DeepSpeed).

Each run is a fresh process (tests/e2e/sft_driver.py). A tiny Llama (fp32, random init) with a word-level
tokenizer, texts of 3-24 Zipf-drawn words, SFTConfig's defaults (gradient checkpointing on, packing
"bfd": padding-free rows with packed position ids) but for max_length 32, batch 2, accumulation 2,
4 steps, lr 1e-2, bf16 off.
"""
import os
import sys

import pytest
import torch

from helpers import free_port, run_job

pytest.importorskip("trl")
pytest.importorskip("peft")
pytestmark = pytest.mark.slow

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft_driver.py")
BIN = os.path.dirname(sys.executable)
LOSS_TOLERANCE = 1e-6     # every logged loss and mean_token_accuracy (issue 34)
GRADIENT_TOLERANCE = 1e-5  # grad_norm and the final weights


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hf_models import tiny_model, tiny_tokenizer
    folder = tmp_path_factory.mktemp("tiny_llama_sft")
    tiny_model("llama").save_pretrained(str(folder))
    tiny_tokenizer().save_pretrained(str(folder))
    return str(folder)


def run(tmp_path, name: str, mode: str, model: str, world_size: int = 1, extra=()):
    port = free_port()
    nvme, out = tmp_path / f"{name}_nvme", tmp_path / f"{name}.pt"
    nvme.mkdir(exist_ok=True)
    driver_args = ["--mode", mode, "--model", model, "--nvme", str(nvme), "--out", str(out),
                   "--output-dir", str(tmp_path / f"{name}_output"), *extra]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                           "LOCAL_SIZE")}
    env.update(MASTER_PORT=port, MASTER_ADDR="127.0.0.1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if world_size == 1:
        command = [sys.executable, DRIVER, *driver_args]
    else:
        env["LOCAL_SIZE"] = str(world_size)  # the CPU accelerator's "device" count, for the launcher
        command = [os.path.join(BIN, "deepspeed"), "--num_gpus", str(world_size), "--master_port", port, DRIVER,
                   *driver_args]
    run_job(name, command, env, port)
    return torch.load(str(out), weights_only=False)


def step_logs(result):
    return [entry for entry in result["log_history"] if "loss" in entry and "train_loss" not in entry]


def relative_differences(first, second):
    assert set(first) == set(second)
    return {name: float((first[name].float() - second[name].float()).norm() / second[name].float().norm())
            for name in second}


def assert_same_steps(got, expected, metrics=True):
    got_steps, expected_steps = step_logs(got), step_logs(expected)
    assert [entry["step"] for entry in got_steps] == [entry["step"] for entry in expected_steps] == [1, 2, 3, 4]
    for mine, theirs in zip(got_steps, expected_steps):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=LOSS_TOLERANCE), mine["step"]
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=GRADIENT_TOLERANCE), mine["step"]
        assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"], rel=1e-12, abs=1e-15), mine["step"]
        assert mine["num_tokens"] == theirs["num_tokens"], mine["step"]
        if metrics:
            assert mine["mean_token_accuracy"] == pytest.approx(theirs["mean_token_accuracy"], rel=LOSS_TOLERANCE,
                                                                abs=1e-12), mine["step"]
            assert mine["entropy"] == pytest.approx(theirs["entropy"], rel=LOSS_TOLERANCE), mine["step"]
    assert got["train_loss"] == pytest.approx(expected["train_loss"], rel=LOSS_TOLERANCE)


def assert_same_eval(got, expected):
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert got["eval"][key] == pytest.approx(expected["eval"][key], rel=LOSS_TOLERANCE, abs=1e-12), key
    assert got["eval"]["eval_num_tokens"] == expected["eval"]["eval_num_tokens"]


def assert_metrics_mean_something(result):
    steps = step_logs(result)
    assert max(entry["mean_token_accuracy"] for entry in steps) > 0.01  # the Zipf data are being learnt
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_packed_sft_matches_plain_sft_trainer(tmp_path, model_dir):
    """Must-show 1: packing on (padding-free rows), accumulation 2, 4 steps: every logged loss,
    mean_token_accuracy, entropy and num_tokens, the eval metrics, grad_norm and the final weights."""
    plain = run(tmp_path, "plain", "plain", model_dir)
    greedysnake = run(tmp_path, "greedysnake", "greedysnake", model_dir)
    assert plain["engine"] == "LlamaForCausalLM" and greedysnake["engine"] == "GreedySnakeEngine"
    assert_same_steps(greedysnake, plain)
    assert_same_eval(greedysnake, plain)
    assert max(relative_differences(greedysnake["weights"], plain["weights"]).values()) <= GRADIENT_TOLERANCE
    assert_metrics_mean_something(plain)
    from hf_models import tiny_model
    initial = {name: param.detach() for name, param in tiny_model("llama").named_parameters()}
    assert min(relative_differences(greedysnake["weights"], initial).values()) > 100 * GRADIENT_TOLERANCE


def test_lora_peft_config_matches_plain_sft_trainer(tmp_path, model_dir):
    """Must-show 1 with peft_config=LoraConfig(...) passed to SFTTrainer: adapters within 1e-5, the base
    unchanged, the same logs."""
    plain = run(tmp_path, "plain_lora", "plain", model_dir, extra=["--lora"])
    greedysnake = run(tmp_path, "lora", "greedysnake", model_dir, extra=["--lora"])
    assert plain["engine"] == "PeftModel"
    assert_same_steps(greedysnake, plain)
    assert_same_eval(greedysnake, plain)
    differences = relative_differences(greedysnake["weights"], plain["weights"])
    adapters = [name for name in differences if "lora_" in name]
    assert adapters and max(differences[name] for name in adapters) <= GRADIENT_TOLERANCE
    from hf_models import tiny_model
    initial = dict(tiny_model("llama").named_parameters())
    for name, value in greedysnake["weights"].items():
        if "lora_" not in name:
            base_name = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(value, initial[base_name].detach()), name  # frozen: bit for bit
    lora_b = [value for name, value in greedysnake["weights"].items() if "lora_B" in name]
    assert all(float(value.abs().max()) > 0 for value in lora_b)  # PEFT starts B at zero: trained


def test_completion_only_loss_on_padded_batches_matches_plain_sft_trainer(tmp_path, model_dir):
    """Must-show 1 on a prompt-completion dataset (the loss on the completions only), packing off: right-
    padded batches whose attention mask the engine's layers apply as the model's forward does."""
    extra = ["--completion-only", "--no-packing"]
    plain = run(tmp_path, "plain_completion", "plain", model_dir, extra=extra)
    greedysnake = run(tmp_path, "completion", "greedysnake", model_dir, extra=extra)
    assert_same_steps(greedysnake, plain)
    assert_same_eval(greedysnake, plain)
    assert max(relative_differences(greedysnake["weights"], plain["weights"]).values()) <= GRADIENT_TOLERANCE
    # Completion-only: fewer tokens have labels than the batches hold (num_tokens counts the mask).
    assert step_logs(plain)[-1]["num_tokens"] > 0


def test_two_ranks_under_the_deepspeed_launcher_match_one_rank(tmp_path, model_dir):
    """Must-show 2: 2 ranks with accumulation 2 under `deepspeed --num_gpus 2` equal 1 rank with
    accumulation 4 (96 texts: the 4 steps stay within one epoch). SFTTrainer appends one
    mean_token_accuracy and entropy per micro-batch, reduced over the ranks, so with another window shape
    it averages other groups of tokens: those two are checked against plain SFTTrainer above, not here."""
    options = ["--samples", "96"]
    one = run(tmp_path, "one", "greedysnake", model_dir, extra=options + ["--gas", "4"])
    two = run(tmp_path, "two", "greedysnake", model_dir, world_size=2, extra=options + ["--gas", "2"])
    assert one["world_size"] == 1 and two["world_size"] == 2 and two["engine"] == "GreedySnakeEngine"
    assert_same_steps(two, one, metrics=False)
    assert max(relative_differences(two["weights"], one["weights"]).values()) <= GRADIENT_TOLERANCE
