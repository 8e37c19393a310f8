"""scripts/bench/zero_reduction_profile.py: a ZeRO-Infinity run's reduction in parts against the probe's, and the
planner's reduction term from the probe's terms. The table's arithmetic on made-up records, never timings."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))

import zero_reduction_profile as profile  # noqa: E402  (scripts/)

NS = 1e-9


def probe_terms(reduce_rate=2e8, boundary=5 * NS):
    parts = {"reduce-scatter": 2 * NS, "partition copies": 0.5 * NS, "rest": 0.1 * NS, "norm (boundary)": 0.8 * NS}
    return {"zero_grad_reduce_elements_per_s": reduce_rate, "zero_reduction_parts_seconds_per_element": parts,
            "zero_optimizer_seconds_per_element": {"gradient reduction (boundary)": boundary}}


def zero_run(m, params=1000, reduction=3e-6, write=1e-6):
    ops = {"gradient reduction": reduction, "gradient reduce-scatter": 1e-6, "gradient partition": 1.5e-6,
           "gradient norm (boundary)": 0.2e-6, "gradient write (boundary)": write}
    return {"engine": "zero_infinity", "micro_batches": m, "parameters": params, "step_seconds_median": 2.0,
            "seconds_by_op_mean": ops}


def test_the_predicted_reduction_is_the_planners_term():
    """M-1 reductions at the probe's rate and the boundary's at its own, per element of a micro-batch."""
    terms = probe_terms(reduce_rate=2e8, boundary=5 * NS)
    assert profile.predicted_reduction(terms, 1) == pytest.approx(5 * NS)
    assert profile.predicted_reduction(terms, 4) == pytest.approx((3 * 5 * NS + 5 * NS) / 4)


def test_each_zero_infinity_run_is_a_row_and_greedysnake_is_left_out():
    report = {"runs": [zero_run(1), {"engine": "greedysnake", "micro_batches": 1}, zero_run(4, reduction=9e-6)]}
    rows = profile.run_rows(report)
    assert [row["micro_batches"] for row in rows] == [1, 4]
    assert rows[0]["reduction"] == pytest.approx((3e-6 - 1e-6) / 1000)  # less the boundary's gradient write
    assert rows[1]["reduction"] == pytest.approx((9e-6 - 1e-6) / 4000)
    assert rows[1]["parts"]["reduce-scatter"] == pytest.approx(1e-6 / 4000)
    table = profile.table([("before", probe_terms()), ("after", probe_terms(reduce_rate=1e8))], rows)
    first_run = next(line for line in table.splitlines() if line.startswith("| run M=1"))
    # The M=1 run's reduction, 2 ns per element, against 5 ns predicted by both probes (M=1 is the boundary alone).
    assert "| 2.00 | 2.50 / 2.50 |" in first_run


def test_a_bad_shape_is_refused_naming_it():
    with pytest.raises(SystemExit):
        profile.parse_args(["--shape", "848x9"])
    with pytest.raises(SystemExit):
        profile.parse_args(["--shape", "848:0:24"])
    args = profile.parse_args(["--shape", "848:9:24", "--micro-batches", "1", "8"])
    assert (args.hidden, args.layers, args.seq_len, args.micro_batches) == (848, 9, 24, [1, 8])
