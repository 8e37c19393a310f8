"""Predicted against measured saturated throughput: the ``--saturated`` reduction on A/B benchmark runs.

    python scripts/ab_bench.py --configs ssd_bound --micro-batch-size 1 --micro-batches 1 4 8 --ranks 1 --out-dir A
    python scripts/ab_bench.py --configs ssd_bound --micro-batch-size 4 --micro-batches 1 4 8 --ranks 1 --out-dir B
    python scripts/saturation_accuracy.py --ab-json A/ab_bench.json B/ab_bench.json [--hardware probe|FILE]

Every one-rank run of the JSONs (one micro-batch size per ab_bench invocation, any M) is predicted with
the configuration it ran (``scripts/planner_accuracy.py``: one probe per JSON, since the probe times the
layers at the run's micro-batch size). For each engine, the measured and the predicted points go
through the same reduction as ``python -m ds_greedysnake.plan --saturated``
(``ds_greedysnake.planner.saturation.saturation_of``): the best tokens/s per global batch, the plateau
(the best of the sweep) and the saturation point (the smallest global batch within 95% of it). Prints
both curves, each engine's predicted / measured plateau, and exits with status 1 when one is outside
0.8-1.2. A benchmark, never a test: the machine's rates drift between runs (docs/planner.md).
"""
import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

TOLERANCE = 0.2


def points_of(report: dict, rows: list):
    """(measured, predicted) SweepPoints of the one-rank runs of ``report``, in the order of ``rows``."""
    from ds_greedysnake.planner.saturation import SweepPoint
    runs = [run for run in report["runs"] if run.get("world_size", 1) == 1]
    measured, predicted = [], []
    for run, row in zip(runs, rows):
        assert (run["engine"], run["micro_batches"]) == (row["engine"], row["micro_batches"])
        tokens = run["tokens_per_step"]
        for target, seconds in ((measured, row["measured_seconds"]), (predicted, row["predicted_seconds"])):
            target.append(SweepPoint(run["engine"], run["micro_batch_size"], run["micro_batches"], 1, tokens / seconds,
                                     seconds, row["binding"] if target is predicted else ""))
    return measured, predicted


def compare(measured: list, predicted: list) -> dict:
    from ds_greedysnake.planner.saturation import saturation_of
    result = {}
    for engine in sorted({point.engine for point in measured}):
        curves = {}
        for label, points in (("measured", measured), ("predicted", predicted)):
            curve, plateau, knee = saturation_of([p for p in points if p.engine == engine])
            curves[label] = {"curve": [p.to_dict() for p in curve], "plateau": plateau.to_dict(),
                             "saturation_point": knee.to_dict()}
        curves["plateau_ratio"] = (curves["predicted"]["plateau"]["tokens_per_second"]
                                   / curves["measured"]["plateau"]["tokens_per_second"])
        result[engine] = curves
    return result


def markdown(result: dict) -> str:
    lines = []
    for engine, curves in result.items():
        predicted = {p["global_batch"]: p for p in curves["predicted"]["curve"]}
        lines += [f"\n{engine}:", "| global batch | measured: micro-batch x M, tokens/s | predicted: micro-batch x M, "
                  "tokens/s (binds) | predicted / measured |", "|---|---|---|---|"]
        for point in curves["measured"]["curve"]:
            other = predicted[point["global_batch"]]
            lines.append(f"| {point['global_batch']} | {point['micro_batch_size']} x {point['micro_batches']}, "
                         f"{point['tokens_per_second']:.1f} | {other['micro_batch_size']} x {other['micro_batches']}, "
                         f"{other['tokens_per_second']:.1f} ({other['binding']}) | "
                         f"{other['tokens_per_second'] / point['tokens_per_second']:.2f} |")
        m, p = curves["measured"], curves["predicted"]
        lines.append(f"saturated: measured {m['plateau']['tokens_per_second']:.1f} tokens/s (micro-batch "
                     f"{m['plateau']['micro_batch_size']} x M={m['plateau']['micro_batches']}; saturation point: "
                     f"global batch {m['saturation_point']['global_batch']}), predicted "
                     f"{p['plateau']['tokens_per_second']:.1f} (micro-batch {p['plateau']['micro_batch_size']} x "
                     f"M={p['plateau']['micro_batches']}; saturation point: global batch "
                     f"{p['saturation_point']['global_batch']}): predicted / measured {curves['plateau_ratio']:.2f}")
    if {"greedysnake", "zero_infinity"} <= set(result):
        ratio = {label: result["greedysnake"][label]["plateau"]["tokens_per_second"]
                 / result["zero_infinity"][label]["plateau"]["tokens_per_second"] for label in ("measured", "predicted")}
        lines.append(f"\nsaturated ratio greedysnake / ZeRO-Infinity: measured {ratio['measured']:.2f}x, "
                     f"predicted {ratio['predicted']:.2f}x")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ab-json", nargs="+", required=True, help="ab_bench.json files (one micro-batch size each)")
    parser.add_argument("--hardware", default="probe", help="'probe' (once per JSON) or a hardware JSON file")
    parser.add_argument("--nvme-path", default=os.path.join(REPO, ".nvme_swap", "planner_probe"))
    parser.add_argument("--out", default=None, help="write the curves, rows and probes as JSON here")
    args = parser.parse_args(argv)
    from planner_accuracy import markdown as rows_markdown, predict_runs
    measured, predicted, per_json = [], [], []
    for path in args.ab_json:
        with open(path) as handle:
            report = json.load(handle)
        rows, hardware = predict_runs(report, args.hardware, args.nvme_path)
        print(f"{path}:\n{rows_markdown(rows)}", flush=True)
        more_measured, more_predicted = points_of(report, rows)
        measured += more_measured
        predicted += more_predicted
        per_json.append({"ab_json": os.path.abspath(path), "rows": rows, "hardware": hardware})
    result = compare(measured, predicted)
    print(markdown(result))
    verdict = all(1 - TOLERANCE <= curves["plateau_ratio"] <= 1 + TOLERANCE for curves in result.values())
    print(f"\nevery engine's predicted saturated tokens/s within {100 * TOLERANCE:.0f}% of the measured: "
          f"{'yes' if verdict else 'NO'}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"engines": result, "runs": per_json}, handle, indent=1)
    sys.stdout.flush()
    os._exit(0 if verdict else 1)  # DeepSpeed's native threads have aborted at interpreter exit here


if __name__ == "__main__":
    main()
