"""The stages of scripts/gpu_check.sh, each in its own process, each writing one JSON file.

    python scripts/bench/gpu_check/gpu_check.py parity --dtype fp32 --out DIR/parity_fp32.json
    python scripts/bench/gpu_check/gpu_check.py profile --out DIR/profile.json [--small]
    python scripts/bench/gpu_check/gpu_check.py report DIR        # gpu_check.json and report.md from the stages' files

parity: greedysnake on the tiny GPT of the parity tests (3 blocks, hidden 320, M=4, 3 steps) against plain
PyTorch AdamW with gradient accumulation on the same device, with the tolerances of
tests/e2e/test_parity.py. profile: one training step under torch.profiler after a warm-up step; how much
of each layer's host-to-device parameter copy ran under compute (scripts/bench/gpu_check/gpu_check_profile.py).
"""
import argparse
import atexit
import json
import os
import platform
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "e2e"), REPO, os.path.dirname(__file__)]
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                   ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531")):
    os.environ.setdefault(key, value)

# The profiled model: compute per layer large enough to hide a layer's copy on a recent GPU (an H200's
# bf16 block forward over 8 x 8 x 1024 tokens is ~10 ms, its 100 MB copy ~2-4 ms); --small for the CPU.
PROFILE_MODEL = dict(hidden=2048, layers=4, heads=16, vocab=8192, seq_len=1024, micro_batch_size=8, micro_batches=8)
PROFILE_MODEL_SMALL = dict(hidden=256, layers=3, heads=4, vocab=1024, seq_len=32, micro_batch_size=2, micro_batches=4)


def _environment() -> dict:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    info = {"accelerator": accelerator.device_name(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "torch_cuda": torch.version.cuda, "host": platform.node(), "cpus": os.cpu_count()}
    if accelerator.device_name() == "cuda":
        info["device"] = torch.cuda.get_device_name()
    return info


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (list, dict))}))


def _scratch(args) -> str:
    """A fresh folder on the SSD for one stage's swap files, removed when the process exits."""
    root = args.nvme_path or os.path.join(REPO, ".nvme_swap", "gpu_check")
    os.makedirs(root, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="gpu_check_", dir=root)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def parity(args) -> None:
    from ds_greedysnake.deepspeed_compat import accelerator_device
    from greedysnake_run import run_greedysnake
    from helpers import data, fresh_model, reference_training, relative_l2, tiny_gpt_config
    from test_parity import BF16_TOLERANCE, FP32_TOLERANCE, NUM_MICRO_BATCHES, STEPS

    started = time.perf_counter()
    bf16 = args.dtype == "bf16"
    device = accelerator_device()
    config = tiny_gpt_config()
    run = run_greedysnake(_scratch(args), NUM_MICRO_BATCHES, STEPS, bf16=bf16)
    run.engine.close()
    # Plain PyTorch on the same device, fp32 (the bf16 tolerance is against fp32, as in the test).
    on_device = ((inputs.to(device), labels.to(device)) for inputs, labels in data(config))
    reference, reference_losses = reference_training(fresh_model(config).to(device), config, NUM_MICRO_BATCHES,
                                                     STEPS, batches=on_device)
    reference = reference.cpu()
    error = relative_l2(run.masters, reference)
    tolerance = BF16_TOLERANCE if bf16 else FP32_TOLERANCE
    _write(args.out, {"stage": f"parity_{args.dtype}", "environment": _environment(), "device": str(device),
                      "relative_l2": error, "tolerance": tolerance, "passed": error <= tolerance,
                      "moved_from_initial": relative_l2(run.masters, fresh_model(config)),
                      "losses": run.losses, "reference_losses": reference_losses, "steps": STEPS,
                      "micro_batches": NUM_MICRO_BATCHES, "seconds": time.perf_counter() - started})


def _train_counting_syncs(engine, batches, on_gpu: bool) -> dict:
    """One train_batch; on a GPU under torch's sync debug mode, the synchronizing CUDA calls it made (each one
    a host wait: the reads of the losses and the norms at least), by call site."""
    import warnings
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if on_gpu:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.train_batch(batches)
        finally:
            if on_gpu:
                torch.cuda.set_sync_debug_mode(0)
    sites: dict = {}
    for warning in caught:
        if "synchroniz" in str(warning.message):
            site = f"{os.path.relpath(warning.filename, REPO)}:{warning.lineno}"
            sites[site] = sites.get(site, 0) + 1
    return sites


def profile(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity

    import ds_greedysnake
    from deepspeed.accelerator import get_accelerator
    from ds_greedysnake.models.gpt import GPTConfig, build_gpt, lm_loss, micro_batches, synthetic_corpus
    from ds_greedysnake.runtime.schedule import fetch_order
    from gpu_check_profile import layer_copy_overlap
    from helpers import ds_config

    started = time.perf_counter()
    model = dict(PROFILE_MODEL_SMALL if args.small else PROFILE_MODEL)
    accelerator = get_accelerator()
    on_gpu = accelerator.device_name() != "cpu"
    config = GPTConfig(vocab_size=model["vocab"], seq_len=model["seq_len"], hidden=model["hidden"],
                       num_heads=model["heads"], num_layers=model["layers"])
    ds = ds_config(_scratch(args), model["micro_batches"], bf16=on_gpu)
    ds["train_micro_batch_size_per_gpu"] = model["micro_batch_size"]
    torch.manual_seed(0)
    engine, _, _, _ = ds_greedysnake.initialize(model=build_gpt(config), config=ds, loss_fn=lm_loss)
    batches = micro_batches(synthetic_corpus(200_000, model["vocab"], 0), model["micro_batch_size"],
                            model["seq_len"], 0)
    engine.train_batch(batches)  # warm-up: allocator, kernels, the worker's first reads
    accelerator.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        step_started = time.perf_counter()
        synchronizing = _train_counting_syncs(engine, batches, on_gpu)
        accelerator.synchronize()
        step_seconds = time.perf_counter() - step_started
    os.makedirs(os.path.dirname(os.path.abspath(args.trace)), exist_ok=True)
    prof.export_chrome_trace(args.trace)
    with open(args.trace) as handle:
        trace = json.load(handle)
    num_layers = len(engine.layers)
    # Layer L-2's second fetch finds it resident (the turn): no copy.
    order = [layer for position, layer in enumerate(fetch_order(num_layers))
             if not (layer == num_layers - 2 and position == num_layers)]
    sequence = [(layer, engine.layers[layer].shard_bytes) for layer in order]
    overlap = layer_copy_overlap(trace, sequence)
    metrics = engine.last_step_metrics
    engine.close()
    note = ("" if on_gpu else "the CPU accelerator: parameters are never copied to a device, so there is no "
            "host-to-device copy to measure; the trace shows the CPU-side ranges only")
    _write(args.out, {"stage": "profile", "environment": _environment(), "model": model, "bf16": on_gpu,
                      "step_seconds": step_seconds, "compute_seconds": metrics.compute_seconds,
                      "seconds_by_op": metrics.seconds_by_op, "hidden_share": overlap["hidden_share"],
                      "copy_ms": overlap["copy_us"] / 1e3, "fetches_expected": overlap["fetches_expected"],
                      "fetches_matched": overlap["fetches_matched"], "kernels": overlap["kernels"],
                      "copies": overlap["copies"], "note": note, "trace": args.trace,
                      "synchronizing_calls": synchronizing,
                      "seconds": time.perf_counter() - started})


# ----------------------------------------------------------------------------- the report


def _load(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def _ab_rows(ab) -> list:
    rows = []
    if not ab:
        return rows
    for m in sorted({run["micro_batches"] for run in ab["runs"]}):
        pair = {run["engine"]: run for run in ab["runs"] if run["micro_batches"] == m and run.get("world_size", 1) == 1}
        if len(pair) == 2:
            gs, zi = pair["greedysnake"], pair["zero_infinity"]
            rows.append({"micro_batches": m, "greedysnake_step_s": gs["step_seconds_median"],
                         "zero_infinity_step_s": zi["step_seconds_median"],
                         "speedup": zi["step_seconds_median"] / gs["step_seconds_median"],
                         "loss_relative_difference": abs(gs["final_loss"] - zi["final_loss"]) / abs(zi["final_loss"])})
    return rows


def _floors(*reports) -> list:
    """greedysnake's step against its own floor (ab_bench_floor.py) in each A/B report, per configuration and M."""
    rows = []
    for ab in reports:
        for run in (ab or {}).get("runs", []):
            if "floors" in run:
                f = run["floors"]
                rows.append({"config": run["config"], "micro_batches": run["micro_batches"],
                             **{key: f[f"{key}_median"] for key in ("step_s", "io_replay_s", "compute_s", "adam_s",
                                                                     "floor_s", "step_over_floor")}})
    return rows


def report(args) -> None:
    folder = args.folder
    stages = _load(os.path.join(folder, "stages.json")) or {}
    fp32, bf16 = _load(os.path.join(folder, "parity_fp32.json")), _load(os.path.join(folder, "parity_bf16.json"))
    ab, prof = _load(os.path.join(folder, "ab", "ab_bench.json")), _load(os.path.join(folder, "profile.json"))
    lora = _load(os.path.join(folder, "ab_lora", "ab_bench.json"))
    setup = _load(os.path.join(folder, "setup.json")) or {}
    rows = _ab_rows(ab)
    at_8 = next((row for row in rows if row["micro_batches"] == 8), None)
    checks = {
        "fp32_parity": None if fp32 is None else fp32["passed"],
        "bf16_parity": None if bf16 is None else bf16["passed"],
        "ssd_bound_m8_speedup_at_least_2x": None if at_8 is None else at_8["speedup"] >= 2.0,
        "h2d_hidden_share_measured": None if prof is None else prof["hidden_share"] is not None,
    }
    summary = {"dry_run": setup.get("dry_run"), "setup": setup, "stages": stages, "checks": checks,
               "parity_fp32": fp32, "parity_bf16": bf16, "ab_ssd_bound": rows, "ab_lora": _ab_rows(lora),
               "floors": _floors(ab, lora),
               "profile": None if prof is None else {k: v for k, v in prof.items() if k != "copies"},
               "profile_copies": None if prof is None else prof["copies"]}
    with open(os.path.join(folder, "gpu_check.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    text = _markdown(summary)
    with open(os.path.join(folder, "report.md"), "w") as handle:
        handle.write(text)
    print(text)


def _verdict(value) -> str:
    return {True: "yes", False: "NO", None: "not run"}[value]


def _markdown(summary: dict) -> str:
    setup, lines = summary["setup"], []
    mode = "CPU dry run (DS_ACCELERATOR=cpu, no CUDA install)" if summary["dry_run"] else "GPU"
    lines += [f"# gpu_check: {mode}", "", f"environment: {json.dumps(setup.get('environment', {}))}", "",
              "| stage | exit | seconds |", "|---|---|---|"]
    for name, stage in summary["stages"].items():
        lines.append(f"| {name} | {stage['exit']}{' (timed out)' if stage['exit'] == 124 else ''} | {stage['seconds']} |")
    lines += ["", "| check | result | value |", "|---|---|---|"]
    for dtype in ("fp32", "bf16"):
        run = summary[f"parity_{dtype}"]
        value = "" if run is None else f"rel. L2 {run['relative_l2']:.2e} (tolerance {run['tolerance']:.0e})"
        lines.append(f"| {dtype} parity vs plain PyTorch | {_verdict(summary['checks'][f'{dtype}_parity'])} | {value} |")
    at_8 = next((row for row in summary["ab_ssd_bound"] if row["micro_batches"] == 8), None)
    speedup = "" if at_8 is None else "{:.2f}x".format(at_8["speedup"])
    lines.append(f"| ssd_bound M=8: greedysnake >= 2x ZeRO-Infinity | "
                 f"{_verdict(summary['checks']['ssd_bound_m8_speedup_at_least_2x'])} | {speedup} |")
    prof = summary["profile"]
    share = None if prof is None else prof["hidden_share"]
    hidden = "" if share is None else "{:.0f}% of {:.1f} ms".format(100 * share, prof["copy_ms"])
    lines.append(f"| share of host-to-device copy hidden under compute measured | {_verdict(summary['checks']['h2d_hidden_share_measured'])}"
                 f" | {hidden} |")
    if summary["ab_ssd_bound"]:
        lines += ["", "| M | greedysnake s/step | ZeRO-Infinity s/step | speedup | final-loss difference |",
                  "|---|---|---|---|---|"]
        for row in summary["ab_ssd_bound"]:
            lines.append(f"| {row['micro_batches']} | {row['greedysnake_step_s']:.3f} | {row['zero_infinity_step_s']:.3f} "
                         f"| {row['speedup']:.2f}x | {row['loss_relative_difference']:.1e} |")
    for row in summary.get("ab_lora", []):
        lines.append(f"\nLoRA M={row['micro_batches']}: greedysnake {row['greedysnake_step_s']:.3f} s/step, ZeRO-Infinity "
                     f"{row['zero_infinity_step_s']:.3f} s/step ({row['speedup']:.2f}x), final-loss difference "
                     f"{row['loss_relative_difference']:.1e}")
    if summary.get("floors"):
        lines += ["", "greedysnake's step against its own floor (its I/O replayed, compute alone, CPU Adam alone; medians):",
                  "", "| config | M | step s | I/O replay s | compute s | Adam s | step / floor |", "|---|---|---|---|---|---|---|"]
        for row in summary["floors"]:
            lines.append(f"| {row['config']} | {row['micro_batches']} | {row['step_s']:.3f} | {row['io_replay_s']:.3f} | "
                         f"{row['compute_s']:.3f} | {row['adam_s']:.3f} | {row['step_over_floor']:.2f}x |")
    if summary["profile_copies"]:
        lines += ["", "| fetch | layer | MB | copy ms | hidden |", "|---|---|---|---|---|"]
        for copy in summary["profile_copies"]:
            share = "" if copy["hidden_share"] is None else "{:.0f}%".format(100 * copy["hidden_share"])
            lines.append(f"| {copy['fetch']} | {copy['layer']} | {copy['bytes'] / 1e6:.1f} | {copy['duration_us'] / 1e3:.2f} "
                         f"| {share} |")
    if prof is not None and "synchronizing_calls" in prof:
        calls = prof["synchronizing_calls"]
        lines += ["", f"profiled step: {sum(calls.values())} synchronizing CUDA calls (torch's sync debug mode, each "
                  "a host wait)" + "".join(f"; {count} at {site}" for site, count in sorted(calls.items()))]
    if prof is not None and prof.get("note"):
        lines += ["", f"profile: {prof['note']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    parity_parser = commands.add_parser("parity")
    parity_parser.add_argument("--dtype", choices=("fp32", "bf16"), required=True)
    profile_parser = commands.add_parser("profile")
    profile_parser.add_argument("--small", action="store_true", help="a model sized for the CPU accelerator")
    profile_parser.add_argument("--trace", default=None, help="chrome trace path (default: next to --out)")
    for sub in (parity_parser, profile_parser):
        sub.add_argument("--out", required=True)
        sub.add_argument("--nvme-path", default=None, help="folder on an SSD (default .nvme_swap/gpu_check)")
    report_parser = commands.add_parser("report")
    report_parser.add_argument("folder")
    args = parser.parse_args(argv)
    if args.command == "profile" and args.trace is None:
        args.trace = os.path.join(os.path.dirname(os.path.abspath(args.out)), "profile_trace.json")
    {"parity": parity, "profile": profile, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
