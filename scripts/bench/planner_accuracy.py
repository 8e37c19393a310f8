"""Predicted against measured step times: the planner's probe and cost model on the A/B benchmark's runs.

    python scripts/bench/planner_accuracy.py --rounds 3                      # the accuracy benchmark (4-8 min)
    python scripts/bench/planner_accuracy.py --rounds 3 --record tests/fixtures/planner_accuracy.json
    python scripts/bench/ab_bench/ab_bench.py --out-dir results/ab_bench            # or: predict any A/B run
    python scripts/bench/planner_accuracy.py --ab-json results/ab_bench/ab_bench.json
    python scripts/bench/planner_accuracy.py --ab-json ... --hardware machine.json   # a saved probe instead

With ``--ab-json``: probes this machine (SSD through the runs' aio block, CPU Adam, each configuration's
layers at its micro-batch size) unless --hardware is given, predicts every run of the JSON with the
configuration it ran (its ds_config: M, micro-batch, ZeRO-3 knobs), and prints a markdown table and
--out JSON.

With ``--rounds N``: N rounds of (one ab_bench run of its SSD-bound configuration, both engines, then one
probe and the predictions); prints each round's table, then each engine's median predicted and median
measured step over the rounds, and exits with status 1 when a median ratio is outside 0.8-1.2. The
machine's rates move between runs minutes apart (docs/ab_bench.md), so the verdict is on medians over
rounds, and it is a benchmark's: tests/unit/planner/test_planner_accuracy.py judges the model on the runs and
probes ``--record`` saved, never on live timings.
"""
import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ab-json", default=None, help="ab_bench.json written by scripts/bench/ab_bench/ab_bench.py")
    parser.add_argument("--rounds", type=int, default=None, help="run the accuracy benchmark: this many rounds "
                        "of (ab_bench run, probe) on ab_bench's SSD-bound configuration")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1], help="with --rounds: the M of each run")
    parser.add_argument("--record", default=None, help="with --rounds: write the runs and probes here (the unit "
                        "test's fixture, tests/fixtures/planner_accuracy.json)")
    parser.add_argument("--work-dir", default=os.path.join(REPO, "results", "planner_accuracy"),
                        help="with --rounds: where each round's ab_bench and accuracy JSON go")
    parser.add_argument("--hardware", default="probe", help="'probe' or a hardware JSON file (without layer times, "
                        "compute comes from its FLOP/s)")
    parser.add_argument("--nvme-path", default=os.path.join(REPO, ".nvme_swap", "planner_probe"),
                        help="folder on the SSD the probe measures")
    parser.add_argument("--save-hardware", default=None, help="write the probe (first configuration's layers) here")
    parser.add_argument("--out", default=None, help="write predictions and measurements as JSON here")
    args = parser.parse_args(argv)
    if (args.ab_json is None) == (args.rounds is None):
        parser.error("give either --ab-json FILE (predict one A/B run) or --rounds N (the accuracy benchmark)")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def engine_keeps_states_in_host() -> bool:
    """Whether this checkout's engine honours ``optimizer_host_memory_mb`` (its shared host memory module
    came with it); before, every optimizer state went through SSD whatever the config said."""
    import ds_greedysnake  # the checkout measured (an editable install elsewhere may have other modules)
    return any(os.path.exists(os.path.join(os.path.dirname(ds_greedysnake.__file__), *where))
               for where in (("host_memory.py",), ("storage", "host_memory.py")))


def predict_runs(report: dict, hardware_arg: str, nvme_path: str, save_hardware=None, recorded=None) -> list:
    """One row per one-rank run of ``report``: measured and predicted step time. ``recorded`` (config name
    -> Hardware) replaces the probe or the hardware file: the unit test predicts recorded runs that way."""
    from ds_greedysnake.planner import (EngineSettings, HorizontalSettings, engine_phases, evaluate,
                                        horizontal_phases, load_hardware, parse_layers, save_hardware as save,
                                        workload_from_settings)
    from ds_greedysnake.planner.zero_model import zero_terms
    from ds_greedysnake.settings import settings_from_ds_config
    rows, hardware_by_config = [], dict(recorded or {})
    for run in report["runs"]:
        if run.get("world_size", 1) > 1:
            continue  # the model is of one rank (docs/planner.md, limitations)
        spec = report["configs"][run["config"]]
        shape = parse_layers(f"blocks={spec['layers']},hidden={spec['hidden']},heads={spec['heads']},"
                             f"vocab={spec['vocab']},seq_len={spec['seq_len']}")
        settings = settings_from_ds_config(run["ds_config"])
        workload = workload_from_settings(settings, shape)
        if run["config"] not in hardware_by_config:
            if hardware_arg != "probe":
                hardware_by_config[run["config"]] = load_hardware(hardware_arg)
            else:
                from ds_greedysnake.planner.probe import probe_engine_cores, probe_layers, probe_machine
                from ds_greedysnake.deepspeed_compat import accelerator_device
                os.makedirs(nvme_path, exist_ok=True)
                if not hardware_by_config:
                    hardware = probe_machine(nvme_path, settings, workload, zero_ds_config=run["ds_config"])
                    if save_hardware:
                        save(hardware, save_hardware)
                else:  # the machine's rates once; the layers per configuration
                    first, device = next(iter(hardware_by_config.values())), accelerator_device()
                    layers = probe_layers(workload, device)
                    block_s = layers["block"].forward_backward_s
                    threads_slowdown, sharing = probe_engine_cores(workload, device, settings,
                                                                   all_threads_block_s=block_s)
                    hardware = dataclasses.replace(first, layer_times=layers,
                                                   layer_times_for=workload.compute_key(),
                                                   compute_slowdown_sharing_cores=sharing,
                                                   engine_threads_slowdown=threads_slowdown)
                hardware_by_config[run["config"]] = hardware
        hardware = hardware_by_config[run["config"]]
        if run["engine"] == "greedysnake":
            engine = EngineSettings.from_settings(settings)
            deferred = engine.deferred(workload)
            host_layers = engine.optimizer_host_layers(workload, deferred) if engine_keeps_states_in_host() else 0
            phases = engine_phases(workload, hardware, deferred, engine.overlap, host_layers)
            # The host shares the run's config gives (checkpoint and gradient budgets, engine defaults).
            shares = engine.shares(workload, float(settings.greedysnake.activation_host_memory_mb) * 2**20)
        else:
            phases = horizontal_phases(workload, hardware, HorizontalSettings.from_settings(settings))
            shares = {}
        prediction = evaluate(run["engine"], phases, workload, shares)
        measured = run["step_seconds_median"]
        if run["engine"] == "zero_infinity" and "seconds_by_phase_mean" in run:
            terms = {"predicted": zero_terms(workload, hardware, HorizontalSettings.from_settings(settings)),
                     "measured": measured_zero_terms(run)}
        else:
            terms = None
        rows.append({"terms": terms, "config": run["config"], "micro_batches": run["micro_batches"], "engine": run["engine"],
                     "measured_seconds": measured, "predicted_seconds": prediction.seconds,
                     "ratio": prediction.seconds / measured, "binding": prediction.binding,
                     "seconds_by_binding": prediction.seconds_by_binding,
                     "predicted_phases": prediction.to_dict()["phases"],
                     "measured_seconds_by_op": run.get("seconds_by_op_mean")})
    return rows, {name: hw.to_dict() for name, hw in hardware_by_config.items()}


def measured_zero_terms(run: dict) -> dict:
    """A ZeRO-Infinity run's profile (ab_bench's ``seconds_by_op_mean`` and ``seconds_by_phase_mean``, per
    step) under ``zero_model.zero_terms``'s names: the reduction without the boundary's gradient write it
    holds, and compute as what the forwards and backwards took besides reads and reductions."""
    ops, phases = run["seconds_by_op_mean"], run["seconds_by_phase_mean"]
    passes = phases["forward"] + phases.get("backward", 0.0) + phases.get("backward (boundary)", 0.0)
    terms = {"parameter read": ops["parameter read"],
             "parameter reads": statistics.median(s["param_reads"] for s in run["steps"] if not s["warmup"]),
             "compute": passes - ops["parameter read"] - ops["gradient reduction"],
             "gradient reduction": ops["gradient reduction"] - ops["gradient write (boundary)"],
             "gradient write (boundary)": ops["gradient write (boundary)"]}
    terms.update({name: ops[name] for name in ("optimizer state read", "Adam", "parameter write",
                                                "optimizer state write")})
    terms["optimizer step, beyond its parts"] = ops["optimizer step"] - sum(
        ops[name] for name in ("optimizer state read", "Adam", "parameter write", "optimizer state write"))
    return terms


def terms_markdown(rows: list) -> str:
    """Per ZeRO-Infinity run: each term of the model against the profile."""
    lines = []
    for row in rows:
        if not row.get("terms"):
            continue
        predicted, measured = row["terms"]["predicted"], row["terms"]["measured"]
        lines += [f"\nZeRO-Infinity M={row['micro_batches']}: term, measured s, predicted s, predicted / measured",
                  "| term | measured | predicted | ratio |", "|---|---|---|---|"]
        for name, value in measured.items():
            guess = predicted.get(name)
            ratio = f"{guess / value:.2f}" if guess is not None and value > 0 else "-"
            lines.append(f"| {name} | {value:.3f} | {'-' if guess is None else f'{guess:.3f}'} | {ratio} |")
    return "\n".join(lines)


def markdown(rows: list) -> str:
    lines = ["| config | M | engine | measured s | predicted s | predicted / measured | binds (predicted) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['micro_batches']} | {row['engine']} | {row['measured_seconds']:.3f} | "
                     f"{row['predicted_seconds']:.3f} | {row['ratio']:.2f} | {row['binding']} |")
    worst = max(abs(row["ratio"] - 1) for row in rows)
    lines.append(f"\nlargest error {100 * worst:.0f}% over {len(rows)} runs")
    return "\n".join(lines) + terms_markdown(rows)


TOLERANCE = 0.2
# The fields of an ab_bench run the predictions read (and the fixture keeps).
RECORDED_RUN_FIELDS = ("config", "engine", "micro_batches", "world_size", "ds_config", "step_seconds_median",
                       "seconds_by_op_mean")


def medians_by_engine(rows_by_round) -> dict:
    """engine -> (median predicted s, median measured s, their ratio) over every round's rows."""
    result = {}
    for engine in sorted({row["engine"] for rows in rows_by_round for row in rows}):
        predicted = statistics.median(row["predicted_seconds"] for rows in rows_by_round for row in rows
                                      if row["engine"] == engine)
        measured = statistics.median(row["measured_seconds"] for rows in rows_by_round for row in rows
                                     if row["engine"] == engine)
        result[engine] = (predicted, measured, predicted / measured)
    return result


def within_tolerance(medians: dict) -> bool:
    return all(1 - TOLERANCE <= ratio <= 1 + TOLERANCE for _, _, ratio in medians.values())


def format_medians(medians: dict, rounds: int) -> str:
    lines = [f"| engine | median predicted s | median measured s | predicted / measured ({rounds} rounds) |",
             "|---|---|---|---|"]
    lines += [f"| {engine} | {predicted:.3f} | {measured:.3f} | {ratio:.2f} |"
              for engine, (predicted, measured, ratio) in medians.items()]
    return "\n".join(lines)


def recorded_round(report: dict, hardware: dict) -> dict:
    """What the unit test needs of one round: the runs as ab_bench measured them and the probe."""
    return {"configs": report["configs"], "hardware": hardware,
            "runs": [{key: run.get(key) for key in RECORDED_RUN_FIELDS} for run in report["runs"]]}


def predict_recorded_round(recorded: dict) -> list:
    """The rows of one recorded round, predicted from its recorded probe (no measuring)."""
    from ds_greedysnake.planner.hardware import hardware_from_dict
    hardware = {name: hardware_from_dict(data) for name, data in recorded["hardware"].items()}
    rows, _ = predict_runs(recorded, "recorded", "", recorded=hardware)
    return rows


def _run_checked(command: list, env: dict) -> str:
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if completed.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({completed.returncode}):\n{completed.stdout[-3000:]}\n"
                         f"{completed.stderr[-3000:]}")
    return completed.stdout


def run_rounds(args) -> int:
    sys.path.insert(0, os.path.join(REPO, "scripts", "bench", "ab_bench"))
    from ab_bench_setup import free_port, remove_shm_buffers
    nvme = os.path.join(REPO, ".nvme_swap", "planner_accuracy")
    os.makedirs(nvme, exist_ok=True)
    port = free_port()
    env = dict(os.environ, MASTER_PORT=port)
    rows_by_round, recorded = [], []
    try:
        for index in range(args.rounds):
            folder = os.path.join(args.work_dir, f"round{index + 1}")
            os.makedirs(folder, exist_ok=True)
            # The sizes are explicit (the planner's ``ab-ssd-bound``, docs/planner.md), whatever ab_bench's defaults.
            _run_checked([sys.executable, os.path.join(REPO, "scripts", "bench", "ab_bench", "ab_bench.py"), "--configs", "ssd_bound",
                          "--hidden", "512", "--layers", "8", "--seq-len", "8", "--micro-batches",
                          *map(str, args.micro_batches), "--ranks", "1", "--warmup", "1", "--steps", "5", "--no-plot",
                          "--out-dir", folder, "--nvme-path", nvme], env)
            ab_json, accuracy_json = os.path.join(folder, "ab_bench.json"), os.path.join(folder, "accuracy.json")
            table = _run_checked([sys.executable, os.path.abspath(__file__), "--ab-json", ab_json, "--nvme-path",
                                  nvme, "--out", accuracy_json], env)
            with open(ab_json) as handle:
                report = json.load(handle)
            with open(accuracy_json) as handle:
                accuracy = json.load(handle)
            rows_by_round.append(accuracy["rows"])
            recorded.append(recorded_round(report, accuracy["hardware"]))
            print(f"round {index + 1} ({time.strftime('%Y-%m-%d %H:%M:%S')}):\n{table}", flush=True)
    finally:
        remove_shm_buffers(port)
    medians = medians_by_engine(rows_by_round)
    print(format_medians(medians, args.rounds))
    verdict = within_tolerance(medians)
    print(f"every engine's median prediction within {100 * TOLERANCE:.0f}% of its median measured step: "
          f"{'yes' if verdict else 'NO'}")
    if args.record:
        command = "python scripts/bench/planner_accuracy.py " + " ".join(sys.argv[1:])
        with open(args.record, "w") as handle:
            json.dump({"command": command, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                       "machine": f"{os.uname().nodename}, {os.cpu_count()} CPUs", "rounds": recorded}, handle, indent=1)
        print(f"recorded {args.rounds} rounds in {args.record}")
    return 0 if verdict else 1


def main(argv=None):
    args = parse_args(argv)
    if args.rounds is not None:
        sys.exit(run_rounds(args))
    with open(args.ab_json) as handle:
        report = json.load(handle)
    rows, hardware = predict_runs(report, args.hardware, args.nvme_path, args.save_hardware)
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"rows": rows, "hardware": hardware, "ab_json": os.path.abspath(args.ab_json)}, handle, indent=1)
    # DeepSpeed's native threads have aborted at interpreter exit here; the output is written.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
