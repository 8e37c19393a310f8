"""scripts/gpu_check's arithmetic, on synthetic inputs: the copy/compute overlap of a trace, and the report."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "bench", "gpu_check"))

import gpu_check  # noqa: E402
from gpu_check_profile import layer_copy_overlap  # noqa: E402


def _event(category, name, start, duration, **args):
    return {"ph": "X", "cat": category, "name": name, "ts": start, "dur": duration, "args": args}


def test_each_layer_copy_counts_the_time_it_runs_under_any_kernel():
    trace = {"traceEvents": [
        _event("kernel", "gemm", 0, 10, stream=7), _event("kernel", "gemm", 8, 4, stream=7),
        _event("kernel", "softmax", 20, 10, stream=7),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 5, 10, bytes=100, stream=20),   # layer 0: 7 of 10 hidden
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 16, 2, bytes=7, stream=20),     # an activation
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 17, 2, bytes=100, stream=20),   # not to the device
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 22, 4, bytes=100, stream=20),   # layer 1: all hidden
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 40, 4, bytes=100, stream=20),   # beyond the fetches
    ]}
    result = layer_copy_overlap(trace, [(0, 100), (1, 100)])
    assert [(copy["layer"], copy["hidden_share"]) for copy in result["copies"]] == [(0, 0.7), (1, 1.0)]
    assert result["hidden_share"] == (7 + 4) / (10 + 4)
    assert result["fetches_matched"] == 2 and result["kernels"] == 2


def test_no_device_copies_leave_the_share_unknown():
    result = layer_copy_overlap({"traceEvents": []}, [(0, 100)])
    assert result["hidden_share"] is None and result["copies"] == []


def test_the_report_says_what_ran_and_what_did_not(tmp_path):
    (tmp_path / "stages.json").write_text(json.dumps({"parity_fp32": {"exit": 0, "seconds": 20},
                                                      "ab_ssd_bound": {"exit": 124, "seconds": 240}}))
    (tmp_path / "setup.json").write_text(json.dumps({"dry_run": False, "environment": {"accelerator": "cuda"}}))
    (tmp_path / "parity_fp32.json").write_text(json.dumps({"passed": True, "relative_l2": 2e-7, "tolerance": 1e-5}))
    gpu_check.main(["report", str(tmp_path)])
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["checks"] == {"fp32_parity": True, "bf16_parity": None, "ssd_bound_m8_speedup_at_least_2x": None,
                                 "h2d_hidden_share_measured": None}
    report = (tmp_path / "report.md").read_text()
    assert "| ab_ssd_bound | 124 (timed out) | 240 |" in report
    assert "| fp32 parity vs plain PyTorch | yes | rel. L2 2.00e-07 (tolerance 1e-05) |" in report
    assert "| bf16 parity vs plain PyTorch | not run |  |" in report


def test_the_report_gives_the_lora_row_and_each_step_against_its_floor(tmp_path):
    (tmp_path / "stages.json").write_text(json.dumps({"ab_lora": {"exit": 0, "seconds": 30}}))
    floors = {f"{key}_median": value for key, value in
              (("step_s", 0.3), ("io_replay_s", 0.12), ("compute_s", 0.24), ("adam_s", 0.001), ("floor_s", 0.24),
               ("step_over_floor", 1.25))}
    runs = [{"engine": "greedysnake", "config": "lora", "micro_batches": 8, "step_seconds_median": 0.3,
             "final_loss": 7.0, "floors": floors},
            {"engine": "zero_infinity", "config": "lora", "micro_batches": 8, "step_seconds_median": 2.1,
             "final_loss": 7.0}]
    (tmp_path / "ab_lora").mkdir()
    (tmp_path / "ab_lora" / "ab_bench.json").write_text(json.dumps({"runs": runs}))
    gpu_check.main(["report", str(tmp_path)])
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["ab_lora"][0]["speedup"] == pytest.approx(7.0)
    assert summary["floors"] == [{"config": "lora", "micro_batches": 8, "step_s": 0.3, "io_replay_s": 0.12,
                                  "compute_s": 0.24, "adam_s": 0.001, "floor_s": 0.24, "step_over_floor": 1.25}]
    report = (tmp_path / "report.md").read_text()
    assert "LoRA M=8: greedysnake 0.300 s/step, ZeRO-Infinity 2.100 s/step (7.00x)" in report
    assert "| lora | 8 | 0.300 | 0.120 | 0.240 | 0.001 | 1.25x |" in report


def test_the_report_counts_the_profiled_steps_synchronizing_calls(tmp_path):
    (tmp_path / "stages.json").write_text(json.dumps({"profile": {"exit": 0, "seconds": 30}}))
    (tmp_path / "setup.json").write_text(json.dumps({"dry_run": False, "environment": {"accelerator": "cuda"}}))
    (tmp_path / "profile.json").write_text(json.dumps({
        "hidden_share": 0.9, "copy_ms": 12.0, "copies": [], "note": "",
        "synchronizing_calls": {"ds_greedysnake/storage/transfers.py:61": 2, "ds_greedysnake/runtime/layer.py:300": 4}}))
    gpu_check.main(["report", str(tmp_path)])
    report = (tmp_path / "report.md").read_text()
    assert ("profiled step: 6 synchronizing CUDA calls (torch's sync debug mode, each a host wait); "
            "4 at ds_greedysnake/runtime/layer.py:300; 2 at ds_greedysnake/storage/transfers.py:61") in report
