"""accelerate without Trainer: ``ds_greedysnake.prepare`` gives the engine to accelerate, whose own
``save_state`` / ``load_state`` save and resume it exactly, on one rank and on two (where DeepSpeed's
ZeRO-Infinity races its ranks into one folder under save_state: DeepSpeed issue #7549).

Each run is a fresh process (tests/e2e/accelerate_driver.py), as a user's script is."""
import os
import sys

import pytest
import torch

from helpers import free_port, run_job

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_driver.py")


def run(tmp_path, name: str, world_size: int, *driver_args):
    port = free_port()
    nvme = tmp_path / f"{name}_nvme"
    nvme.mkdir()
    out = tmp_path / f"{name}.pt"
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                           "LOCAL_SIZE")}
    env.update(MASTER_PORT=port, MASTER_ADDR="127.0.0.1")
    arguments = [DRIVER, "--nvme", str(nvme), "--out", str(out), *driver_args]
    if world_size == 1:
        command = [sys.executable, *arguments]
    else:
        env["LOCAL_SIZE"] = str(world_size)  # the CPU accelerator's "device" count, for the launcher
        command = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(world_size),
                   "--master_port", port, *arguments]
    run_job(name, command, env, port)
    return torch.load(str(out), weights_only=False)


@pytest.mark.parametrize("world_size", [1, 2])
def test_save_state_then_load_state_resumes_exactly(tmp_path, world_size):
    state = str(tmp_path / "state")
    whole = run(tmp_path, "whole", world_size, "--state", state, "--steps", "4", "--save-after", "2")
    assert whole["engine"] == "GreedySnakeEngine"
    assert whole["processes"] == world_size
    # accelerate's own files beside the engine's checkpoint: one RNG state per rank.
    assert {"pytorch_model", "latest", "zero_to_fp32.py"} <= set(whole["state_files"])
    assert {f"random_states_{rank}.pkl" for rank in range(world_size)} <= set(whole["state_files"])
    assert len(set(whole["rates"][2:])) == 2, "WarmupLR changes the rate in the steps after the save"
    assert "train_batch" in whole["backward_error"]

    resumed = run(tmp_path, "resumed", world_size, "--state", state, "--steps", "2", "--resume", "2")
    assert resumed["losses"] == whole["losses"][2:]
    assert resumed["rates"] == whole["rates"][2:]
    assert resumed["masters"].keys() == whole["masters"].keys()
    for name, value in whole["masters"].items():
        assert torch.equal(resumed["masters"][name], value), name
