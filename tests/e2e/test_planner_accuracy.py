"""The planner's prediction against a measured run: one small SSD-bound configuration, both engines.

Runs scripts/ab_bench.py on its SSD-bound configuration (8 blocks of hidden 512, vocab 2048, micro-batch
1 x 8 tokens: the planner's ``ab-ssd-bound``) at M=1, 5 measured steps (so that one disturbed step does
not move the median), then scripts/planner_accuracy.py, which probes this machine and predicts each run's
step time; over several such rounds, each engine's median prediction must be within 20% of its median
measured step.
"""
import json
import os
import statistics
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
# measured 0.35-0.49 s in five runs within ten minutes on 2026-12-01, ZeRO-Infinity's 0.84-1.14 s, and the
# virtual disk's rate moved up to 1.9x within seconds (docs/ab_bench.md). One run against one probe missed
# 20% both ways for both engines (six attempts in a row, 2026-12-01), so the test compares medians over
# rounds of (run, probe): at least three, up to six, judged after each from the third.
FIRST_VERDICT, MAX_ROUNDS = 3, 6


def medians_by_engine(rows_by_round) -> dict:
    """engine -> (median predicted s, median measured s, their ratio) over the rounds so far."""
    result = {}
    for engine in ("greedysnake", "zero_infinity"):
        predicted = statistics.median(row["predicted_seconds"] for rows in rows_by_round for row in rows
                                      if row["engine"] == engine)
        measured = statistics.median(row["measured_seconds"] for rows in rows_by_round for row in rows
                                     if row["engine"] == engine)
        result[engine] = (predicted, measured, predicted / measured)
    return result


def measure_and_predict(tmp_path, port):
    nvme = os.path.join(REPO, ".nvme_swap", "test_planner_accuracy")
    # The sizes are explicit: the one documented in docs/planner.md, whatever ab_bench's defaults.
    run([sys.executable, os.path.join(REPO, "scripts", "ab_bench.py"), "--configs", "ssd_bound", "--hidden", "512",
         "--layers", "8", "--seq-len", "8", "--micro-batches", "1", "--ranks", "1", "--warmup", "1", "--steps", "5",
         "--no-plot", "--out-dir", str(tmp_path), "--nvme-path", nvme], port)
    table = run([sys.executable, os.path.join(REPO, "scripts", "planner_accuracy.py"), "--ab-json",
                 str(tmp_path / "ab_bench.json"), "--nvme-path", nvme, "--out", str(tmp_path / "accuracy.json")], port)
    accuracy = json.loads((tmp_path / "accuracy.json").read_text())
    rows = accuracy["rows"]
    assert sorted(row["engine"] for row in rows) == ["greedysnake", "zero_infinity"]
    probe = {key: value for key, value in next(iter(accuracy["hardware"].values())).items()
             if isinstance(value, float)}  # the probe's rates, shown when the test fails
    return rows, f"{table}\nprobe: {json.dumps(probe)}"


def test_prediction_within_20_percent(tmp_path):
    port = free_port()
    tables, rows_by_round, verdicts = [], [], []
    try:
        for round_index in range(MAX_ROUNDS):
            rows, table = measure_and_predict(tmp_path / f"round{round_index}", port)
            rows_by_round.append(rows)
            tables.append(table)
            print(f"round {round_index + 1}:\n{table}")  # shown with pytest -rA
            if len(rows_by_round) >= FIRST_VERDICT:
                medians = medians_by_engine(rows_by_round)
                verdicts.append(f"after {len(rows_by_round)} rounds, median predicted / median measured: " +
                                ", ".join(f"{engine} {p:.3f} / {m:.3f} = {ratio:.2f}"
                                          for engine, (p, m, ratio) in medians.items()))
                print(verdicts[-1])
                if all(0.8 <= ratio <= 1.2 for _, _, ratio in medians.values()):
                    return
    finally:
        remove_shm_buffers(port)
    pytest.fail(f"median predicted step time off by more than 20% after {MAX_ROUNDS} rounds:\n" +
                "\n".join(verdicts) + "\n" + "\n".join(tables))


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
