"""scripts/train_hf_trainer.py end to end on a tiny model, one rank: under `deepspeed --num_gpus 1` with
checkpoints and save_model, with --baseline (ZeRO-Infinity), and under `accelerate launch`."""
import json
import os
import subprocess
import sys

import pytest

from helpers import free_port, remove_shm_buffers

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "train_hf_trainer.py")
BIN = os.path.dirname(sys.executable)
TINY = ["--family", "gpt2", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "300", "--seq-len", "32",
        "--micro-batches", "2", "--steps", "2", "--fp32"]


def launch(command, port):
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(MASTER_PORT=port, MASTER_ADDR="127.0.0.1", HF_HUB_OFFLINE="1", LOCAL_SIZE="1")
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    finally:
        remove_shm_buffers(port)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    # The report is the script's last line; the deepspeed launcher prints its own lines after it.
    return json.loads([line for line in done.stdout.splitlines() if line.startswith('{"engine"')][-1])


def deepspeed_launch(*script_args):
    port = free_port()
    return launch([os.path.join(BIN, "deepspeed"), "--num_gpus", "1", "--master_port", port, SCRIPT, *TINY,
                   *script_args], port)


def test_trains_checkpoints_and_saves_a_model(tmp_path):
    from transformers import AutoModelForCausalLM
    output = tmp_path / "output"
    report = deepspeed_launch("--nvme-path", str(tmp_path / "nvme"), "--output-dir", str(output),
                              "--checkpoint-every", "1", "--save-model", str(tmp_path / "model"))
    assert report["engine_class"] == "GreedySnakeEngine" and report["steps"] == 2
    assert len(report["losses"]) == 2 and all(norm is not None and norm > 0 for norm in report["grad_norms"])
    assert report["peak_rss_training"]["process_gib"] > 0
    assert sorted(os.listdir(output)) == ["checkpoint-1", "checkpoint-2"]
    assert "global_step2" in os.listdir(output / "checkpoint-2")
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).config.n_layer == 2


def test_baseline_is_zero_infinity(tmp_path):
    report = deepspeed_launch("--nvme-path", str(tmp_path / "nvme"), "--baseline")
    assert report["engine_class"] == "DeepSpeedEngine" and report["engine"] == "ZeRO-Infinity"
    assert len(report["losses"]) == 2


def test_accelerate_launch_with_a_deepspeed_config(tmp_path):
    with open(os.path.join(REPO, "configs", "greedysnake_hf_trainer.json")) as handle:
        config = json.load(handle)
    (tmp_path / "nvme").mkdir()
    for section in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][section]["nvme_path"] = str(tmp_path / "nvme")
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    port = free_port()
    report = launch([os.path.join(BIN, "accelerate"), "launch", "--num_processes", "1", "--num_machines", "1",
                     "--use_deepspeed", "--deepspeed_config_file", str(tmp_path / "ds_config.json"),
                     "--main_process_port", port, SCRIPT, *TINY, "--config-from-launcher",
                     "--output-dir", str(tmp_path / "output")], port)
    assert report["engine_class"] == "GreedySnakeEngine" and len(report["losses"]) == 2
