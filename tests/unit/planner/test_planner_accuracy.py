"""The planner's prediction against recorded step times: both engines on ab_bench's SSD-bound configuration.

The fixture holds rounds of (ab_bench run, probe of this machine right after it), measured once by the
command it names (``scripts/bench/planner_accuracy.py --rounds 3 --record ...``, docs/planner.md). Each round's
runs are predicted from that round's recorded probe, so the verdict depends on the cost model alone,
not on how loaded the machine running the suite is. The live check of the same thing is that benchmark;
rerun it and re-record when the planner or the engine's timing changes.
"""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "planner_accuracy.json")

import planner_accuracy  # noqa: E402  (scripts/)


@pytest.fixture(scope="module")
def recorded():
    with open(FIXTURE) as handle:
        return json.load(handle)


def test_fixture_states_how_it_was_measured(recorded):
    assert recorded["command"].startswith("python scripts/bench/planner_accuracy.py --rounds")
    assert recorded["measured_at"] and len(recorded["rounds"]) >= 3
    for round_ in recorded["rounds"]:
        assert {run["engine"] for run in round_["runs"]} == {"greedysnake", "zero_infinity"}
        assert all(run["step_seconds_median"] > 0 for run in round_["runs"])


@pytest.fixture(scope="module")
def medians(recorded):
    rows_by_round = [planner_accuracy.predict_recorded_round(round_) for round_ in recorded["rounds"]]
    assert all(len(rows) == len(round_["runs"]) for rows, round_ in zip(rows_by_round, recorded["rounds"]))
    return planner_accuracy.medians_by_engine(rows_by_round)


# ZeRO-Infinity's model predicted 0.64x of the recorded median step until issue 33 (strictly expected to fail
# here then). These rounds were re-recorded (2026-12-06) when greedysnake's step became a timeline beside the
# worker's queue and the probe gained the engine's own compute slow-down: greedysnake 1.01, ZeRO-Infinity
# 0.83 at recording; the rounds before them, whose probe predated both, gave 0.72 under the new model.
@pytest.mark.parametrize("engine", ["greedysnake", "zero_infinity"])
def test_median_prediction_within_20_percent_of_recorded_steps(medians, engine):
    predicted, measured, ratio = medians[engine]
    assert 1 - planner_accuracy.TOLERANCE <= ratio <= 1 + planner_accuracy.TOLERANCE, \
        planner_accuracy.format_medians(medians, 3)


def test_a_prediction_far_off_is_caught(recorded):
    """The verdict can fail: the same rounds with greedysnake's measured steps halved miss by far more than 20%."""
    rounds = json.loads(json.dumps(recorded["rounds"]))
    for round_ in rounds:
        for run in round_["runs"]:
            if run["engine"] == "greedysnake":
                run["step_seconds_median"] /= 2
    medians = planner_accuracy.medians_by_engine([planner_accuracy.predict_recorded_round(r) for r in rounds])
    assert not planner_accuracy.within_tolerance(medians)
    assert medians["greedysnake"][2] > 1.5


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        planner_accuracy.parse_args([])
    with pytest.raises(SystemExit):
        planner_accuracy.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        planner_accuracy.parse_args(["--rounds", "2", "--ab-json", "x.json"])
