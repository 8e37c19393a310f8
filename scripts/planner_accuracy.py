"""Predicted against measured step times: the planner's probe and cost model on the A/B benchmark's runs.

    python scripts/ab_bench.py --out-dir results/ab_bench            # measures both engines
    python scripts/planner_accuracy.py --ab-json results/ab_bench/ab_bench.json
    python scripts/planner_accuracy.py --ab-json ... --hardware machine.json   # a saved probe instead

Probes this machine (SSD through the runs' aio block, CPU Adam, each configuration's layers at its
micro-batch size) unless --hardware is given, predicts every run of the JSON with the configuration
it ran (its ds_config: M, micro-batch, ZeRO-3 knobs), and prints a markdown table and --out JSON.
"""
import argparse
import dataclasses
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ab-json", required=True, help="ab_bench.json written by scripts/ab_bench.py")
    parser.add_argument("--hardware", default="probe", help="'probe' or a hardware JSON file (without layer times, "
                        "compute comes from its FLOP/s)")
    parser.add_argument("--nvme-path", default=os.path.join(REPO, ".nvme_swap", "planner_probe"),
                        help="folder on the SSD the probe measures")
    parser.add_argument("--save-hardware", default=None, help="write the probe (first configuration's layers) here")
    parser.add_argument("--out", default=None, help="write predictions and measurements as JSON here")
    return parser.parse_args(argv)


def engine_keeps_states_in_host() -> bool:
    """Whether this checkout's engine honours ``optimizer_host_memory_mb`` (its shared host memory module
    came with it); before, every optimizer state went through SSD whatever the config said."""
    import ds_greedysnake  # the checkout measured (an editable install elsewhere may have other modules)
    return os.path.exists(os.path.join(os.path.dirname(ds_greedysnake.__file__), "host_memory.py"))


def predict_runs(report: dict, hardware_arg: str, nvme_path: str, save_hardware=None) -> list:
    from ds_greedysnake.planner import (EngineSettings, HorizontalSettings, engine_phases, evaluate,
                                        horizontal_phases, load_hardware, parse_layers, save_hardware as save,
                                        workload_from_config)
    rows, hardware_by_config = [], {}
    for run in report["runs"]:
        if run.get("world_size", 1) > 1:
            continue  # the model is of one rank (docs/planner.md, limitations)
        spec = report["configs"][run["config"]]
        shape = parse_layers(f"blocks={spec['layers']},hidden={spec['hidden']},heads={spec['heads']},"
                             f"vocab={spec['vocab']},seq_len={spec['seq_len']}")
        ds_config = run["ds_config"]
        workload = workload_from_config(ds_config, shape)
        if run["config"] not in hardware_by_config:
            if hardware_arg != "probe":
                hardware_by_config[run["config"]] = load_hardware(hardware_arg)
            else:
                from ds_greedysnake.planner.probe import probe_layers, probe_machine, probe_sharing_cores
                from ds_greedysnake.deepspeed_compat import accelerator_device
                os.makedirs(nvme_path, exist_ok=True)
                if not hardware_by_config:
                    hardware = probe_machine(nvme_path, ds_config, workload)
                    if save_hardware:
                        save(hardware, save_hardware)
                else:  # the machine's rates once; the layers per configuration
                    first, device = next(iter(hardware_by_config.values())), accelerator_device()
                    hardware = dataclasses.replace(first, layer_times=probe_layers(workload, device),
                                                   layer_times_for=workload.compute_key(),
                                                   compute_slowdown_sharing_cores=probe_sharing_cores(workload, device))
                hardware_by_config[run["config"]] = hardware
        hardware = hardware_by_config[run["config"]]
        if run["engine"] == "greedysnake":
            settings = EngineSettings.from_ds_config(ds_config)
            deferred = settings.deferred(workload)
            host_layers = settings.optimizer_host_layers(workload, deferred) if engine_keeps_states_in_host() else 0
            phases = engine_phases(workload, hardware, deferred, settings.overlap, host_layers)
            # The host shares the run's config gives (checkpoint and gradient budgets, engine defaults).
            block = ds_config.get("greedysnake") or {}
            shares = settings.shares(workload, float(block.get("activation_host_memory_mb", 4096)) * 2**20)
        else:
            phases = horizontal_phases(workload, hardware, HorizontalSettings.from_ds_config(ds_config))
            shares = {}
        prediction = evaluate(run["engine"], phases, workload, shares)
        measured = run["step_seconds_median"]
        rows.append({"config": run["config"], "micro_batches": run["micro_batches"], "engine": run["engine"],
                     "measured_seconds": measured, "predicted_seconds": prediction.seconds,
                     "ratio": prediction.seconds / measured, "binding": prediction.binding,
                     "seconds_by_binding": prediction.seconds_by_binding,
                     "predicted_phases": prediction.to_dict()["phases"],
                     "measured_seconds_by_op": run.get("seconds_by_op_mean")})
    return rows, {name: hw.to_dict() for name, hw in hardware_by_config.items()}


def markdown(rows: list) -> str:
    lines = ["| config | M | engine | measured s | predicted s | predicted / measured | binds (predicted) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['micro_batches']} | {row['engine']} | {row['measured_seconds']:.3f} | "
                     f"{row['predicted_seconds']:.3f} | {row['ratio']:.2f} | {row['binding']} |")
    worst = max(abs(row["ratio"] - 1) for row in rows)
    lines.append(f"\nlargest error {100 * worst:.0f}% over {len(rows)} runs")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
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
