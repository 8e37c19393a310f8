"""Two ranks on the CPU accelerator (gloo) give the one-rank result for the same global batch."""
import os
import subprocess
import sys

import pytest
import torch

from helpers import free_port, remove_shm_buffers

pytestmark = pytest.mark.slow

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dp_driver.py")


def launch(tmp_path, world_size: int, micro_batches_per_rank: int, steps: int, name: str, extra=(),
           expect_success=True):
    """Start every rank as the deepspeed launcher would, wait for all, return rank 0's results
    (or, with expect_success=False, every rank's exit code and output)."""
    port, out = free_port(), tmp_path / f"{name}.pt"
    ranks = []
    for rank in range(world_size):
        environment = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                           LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(subprocess.Popen([sys.executable, DRIVER, "--nvme", str(tmp_path / name), "--out", str(out),
                                       "--micro-batches", str(micro_batches_per_rank), "--steps", str(steps), *extra],
                                      env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [process.communicate(timeout=600)[0] for process in ranks]
    finally:
        for process in ranks:
            process.kill()
        remove_shm_buffers(port)
    if not expect_success:
        return [(process.returncode, output) for process, output in zip(ranks, outputs)]
    for rank, process in enumerate(ranks):
        assert process.returncode == 0, f"rank {rank} failed:\n{outputs[rank][-4000:]}"
    return torch.load(str(out))


def without_key_bias(masters):
    """The key third of each qkv bias gets a gradient that is zero in exact arithmetic (softmax does
    not change when a constant is added to every key of a query), so it holds only rounding noise,
    which Adam scales up to full-size steps: it differs by ~8e-5 relative even between one-rank
    greedysnake and plain PyTorch. Its query and value thirds stay in the comparison."""
    result = {}
    for name, value in masters.items():
        if name.endswith("qkv.bias"):
            query, _, value_part = value.chunk(3)
            result[name] = torch.cat([query, value_part])
        else:
            result[name] = value
    return result


def max_relative_difference(first, second):
    return max(float((first[name] - second[name]).norm() / second[name].norm()) for name in second)


def relative_l2(first, second):
    numerator = sum(float((first[name] - second[name]).norm() ** 2) for name in second)
    return (numerator / sum(float(second[name].norm() ** 2) for name in second)) ** 0.5


def test_two_ranks_match_one_rank(tmp_path):
    one = launch(tmp_path, 1, 4, 3, "one_rank")
    two = launch(tmp_path, 2, 2, 3, "two_ranks")
    assert max_relative_difference(without_key_bias(two["masters"]), without_key_bias(one["masters"])) <= 1e-5
    assert relative_l2(two["masters"], one["masters"]) <= 1e-5
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert one["collective_bytes"][-1] == {}, "one rank needs no collectives"


def test_tied_embeddings_across_ranks_match_pytorch(tmp_path):
    """GPT-2 ties its head to the token embedding (layer 0 lends it to the head): on two ranks the tied
    weight is gathered with the head and its gradient from both uses is reduce-scattered once, with
    layer 0's. Two ranks of 2 micro-batches each equal plain PyTorch over the same 4."""
    pytest.importorskip("transformers")
    from hf_models import hf_data, hf_loss_of, tiny_model
    from helpers import reference_training
    two = launch(tmp_path, 2, 2, 3, "tied", extra=["--hf-family", "gpt2"])
    reference, reference_losses = reference_training(tiny_model("gpt2"), None, 4, 3, batches=hf_data(),
                                                     loss_of=hf_loss_of)
    expected = {name: param.detach() for name, param in reference.named_parameters()}
    assert set(two["masters"]) == set(expected)  # the tied weight counted once
    assert relative_l2(two["masters"], expected) <= 1e-5
    assert relative_l2(two["masters"], {name: param.detach() for name, param in
                                        tiny_model("gpt2").named_parameters()}) > 1e-3  # the weights moved
    assert two["losses"] == pytest.approx(reference_losses, rel=1e-5)


def test_lora_across_ranks_matches_pytorch(tmp_path):
    """PEFT LoRA on GPT-2 over two ranks: the frozen base is sharded and gathered with each layer (the tied
    embedding too), the adapters' gradients reduce-scattered; 2 x 2 micro-batches equal plain PyTorch over
    the same 4, the base comes back unchanged, and every way out works on both ranks (save_pretrained: PEFT's
    adapter files)."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from hf_models import hf_data, hf_loss_of, lora_model
    from helpers import reference_training
    two = launch(tmp_path, 2, 2, 3, "lora", extra=["--hf-family", "gpt2", "--lora",
                                                   "--export", str(tmp_path / "lora_export")])
    start = lora_model("gpt2")
    reference, reference_losses = reference_training(start, None, 4, 3, batches=hf_data(), loss_of=hf_loss_of)
    trainable = {name: param.detach() for name, param in reference.named_parameters() if param.requires_grad}
    assert relative_l2({name: two["masters"][name] for name in trainable}, trainable) <= 1e-5
    assert two["losses"] == pytest.approx(reference_losses, rel=1e-5)
    for name, param in start.named_parameters():
        if not param.requires_grad:
            assert torch.equal(two["masters"][name], param.detach()), name
            assert torch.equal(two["gathered"][name], param.detach()), name
    adapters = load_file(str(tmp_path / "lora_export" / "hf" / "adapter_model.safetensors"))
    assert len(adapters) == len(trainable) and all("lora_" in key for key in adapters)


def test_collective_traffic_does_not_grow_with_micro_batches(tmp_path):
    few = launch(tmp_path, 2, 1, 2, "m1")
    many = launch(tmp_path, 2, 3, 2, "m3")
    assert few["collective_bytes"][-1] == many["collective_bytes"][-1]
    traffic = many["collective_bytes"][-1]
    # Each layer gathered once per sweep (2L - 2 gathers) and reduce-scattered once per step.
    assert traffic["all_gather"] > 0 and traffic["reduce_scatter"] > 0


def test_a_dead_rank_makes_the_others_fail_clearly_and_soon(tmp_path):
    # "Soon" without a stopwatch: launch() gives each rank at most 10 minutes, less than DeepSpeed's
    # 30-minute default collective timeout, so a survivor that waited for that default fails the test
    # there; the driver sets collective_timeout_seconds to 60.
    (survivor_code, survivor_output), (dead_code, _) = launch(
        tmp_path, 2, 1, 3, "dies", extra=["--last-rank-dies-after", "1"], expect_success=False)
    assert dead_code == 3
    assert survivor_code != 0
    assert "failed on rank 0: another rank died" in survivor_output
