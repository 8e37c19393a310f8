"""scripts/train_hf.py end to end on a tiny model: progress bar, checkpoints, the JSON report."""
import json
import math
import os
import subprocess
import sys

import pytest

from helpers import free_port, remove_shm_buffers

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_train_hf(*arguments):
    """scripts/train_hf.py in its own process, as a user starts it; the finished process."""
    port = free_port()
    env = dict(os.environ, MASTER_PORT=port, HF_HUB_OFFLINE="1")
    try:
        done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "train_hf.py"), *arguments], env=env,
                              capture_output=True, text=True, timeout=300)
    finally:
        remove_shm_buffers(port)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_train_hf_trains_reports_and_checkpoints(tmp_path):
    done = run_train_hf("--family", "gpt2", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "300",
                        "--seq-len", "32", "--micro-batches", "2", "--steps", "2", "--checkpoint-every", "1",
                        "--nvme-path", str(tmp_path))
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["engine"] == "greedysnake" and len(report["losses"]) == 2
    assert all(math.isfinite(loss) for loss in report["losses"])
    assert report["peak_rss_training"]["process_gib"] > 0 and report["peak_rss_training"]["children_gib"]
    assert "ssd_GBs=" in done.stderr and "tok_s=" in done.stderr  # the tqdm bar
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step1", "step2", "zero_to_fp32.py"]


def test_lora_from_a_pretrained_folder_saves_the_adapters(tmp_path):
    """--config-path with safetensors weights and --lora: the base streams in from the folder (the model on
    the meta device, the adapters initialised by PEFT), and --save-pretrained writes PEFT's adapter files,
    which load onto the unchanged base."""
    pytest.importorskip("peft")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from hf_models import tiny_model
    tiny_model("llama").save_pretrained(str(tmp_path / "base"))
    done = run_train_hf("--config-path", str(tmp_path / "base"), "--seq-len", "32", "--micro-batches", "2",
                        "--steps", "2", "--lora", "4", "--fp32", "--nvme-path", str(tmp_path / "nvme"),
                        "--save-pretrained", str(tmp_path / "adapter"))
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["lora_rank"] == 4 and 0 < report["trainable_parameters"] < report["parameters"] / 5
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(tmp_path / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    original = {name: param.detach().clone() for name, param in base.named_parameters()}
    tuned = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    lora_b = [param for name, param in tuned.named_parameters() if "lora_B" in name]
    assert lora_b and all(float(param.abs().max()) > 0 for param in lora_b)  # PEFT starts B at zero: trained
    merged = tuned.merge_and_unload()
    assert any(not torch.equal(param.detach(), original[name]) for name, param in merged.named_parameters())
