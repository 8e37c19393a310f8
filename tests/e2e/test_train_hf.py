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


def test_train_hf_trains_reports_and_checkpoints(tmp_path):
    port = free_port()
    env = dict(os.environ, MASTER_PORT=port, HF_HUB_OFFLINE="1")
    command = [sys.executable, os.path.join(REPO, "scripts", "train_hf.py"), "--family", "gpt2", "--hidden", "64",
               "--layers", "2", "--heads", "4", "--vocab", "300", "--seq-len", "32", "--micro-batches", "2",
               "--steps", "2", "--checkpoint-every", "1", "--nvme-path", str(tmp_path)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    finally:
        remove_shm_buffers(port)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["engine"] == "greedysnake" and len(report["losses"]) == 2
    assert all(math.isfinite(loss) for loss in report["losses"])
    assert report["peak_rss_training"]["process_gib"] > 0 and report["peak_rss_training"]["children_gib"]
    assert "ssd_GBs=" in done.stderr and "tok_s=" in done.stderr  # the tqdm bar
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step1", "step2"]
