"""ab_bench.py --busy-cores: each engine runs alone, then beside the busy processes, and the report pairs them."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "bench", "ab_bench"))

import ab_bench  # noqa: E402
from ab_bench_report import busy_table  # noqa: E402


def test_every_engine_runs_alone_then_beside_the_busy_cores():
    args = ab_bench.parse_args(["--configs", "ssd_bound", "--micro-batches", "8", "--ranks", "1", "--busy-cores", "1"])
    runs = [(engine, busy) for *_, engine, busy in ab_bench.runs_in_order({"ssd_bound": {}}, [8], args)]
    assert runs == [("zero_infinity", 0), ("zero_infinity", 1), ("greedysnake", 0), ("greedysnake", 1)] or \
        runs == [("greedysnake", 0), ("greedysnake", 1), ("zero_infinity", 0), ("zero_infinity", 1)]
    args = ab_bench.parse_args(["--configs", "ssd_bound", "--micro-batches", "8", "--ranks", "1"])
    assert [busy for *_, busy in ab_bench.runs_in_order({"ssd_bound": {}}, [8], args)] == [0, 0]


def test_the_busy_table_gives_each_engines_slow_down_and_both_speed_ups():
    def run(engine, busy, seconds):
        return {"config": "ssd_bound", "micro_batches": 8, "world_size": 1, "engine": engine, "busy_cores": busy,
                "step_seconds_median": seconds, "tokens_per_second": 1000 / seconds}

    report = {"busy_cores": 1, "runs": [run("zero_infinity", 0, 4.0), run("zero_infinity", 1, 5.0),
                                        run("greedysnake", 0, 1.0), run("greedysnake", 1, 2.0)]}
    rows = [line for line in busy_table(report) if line.startswith("| ssd_bound")]
    assert rows == ["| ssd_bound | 8 | 1 | ZeRO-Infinity | 4.00 | 5.00 | 1.25x | 4.00x | 2.50x |",
                    "| ssd_bound | 8 | 1 | greedysnake | 1.00 | 2.00 | 2.00x | 4.00x | 2.50x |"]
    assert busy_table({"busy_cores": 0, "runs": report["runs"][::2]}) == []
