"""Predicted against measured saturated throughput: the ``--saturated`` reduction on A/B benchmark runs.

    python scripts/bench/ab_bench/ab_bench.py --configs ssd_bound --micro-batch-size 1 --micro-batches 1 4 8 --ranks 1 --out-dir A
    python scripts/bench/ab_bench/ab_bench.py --configs ssd_bound --micro-batch-size 4 --micro-batches 1 4 8 --ranks 1 --out-dir B
    python scripts/bench/saturation_accuracy.py --ab-json A/ab_bench.json B/ab_bench.json [--hardware probe|FILE]
    python scripts/bench/saturation_accuracy.py --run 1 4 16 --out results/saturation.json   # runs the sweep too (~20 min)
    python scripts/bench/saturation_accuracy.py --run 1 4 --micro-batches 1 4 8 --shapes 384:12:64 576:8:16 \
        704:6:48 960:4:32 --out results/shapes.json      # one sweep per shape (hidden:blocks:tokens), ~9 min each

With ``--run``, the machine is probed (``plan --saturated``) right before and right after each micro-batch
size's runs, and every prediction is the geometric mean of the two probes' (``--probe-after-only``: the
probe after alone, as before 2026-12-05; both are printed). With ``--repeats N``, each size's ab_bench runs
N times between those probes, each run in its own process each time, and a run's measured step is the
median of its N (``median_report``; each repeat alone is counted too): on this machine one process's
disk rate is drawn with where its buffers land.

With ``--shapes``, each shape's sweep runs in turn (each micro-batch size's runs, then its predictions),
then a table of every shape: per engine the measured and ``--saturated``-predicted saturated tokens/s and
the worst one-rank run; exit status 0 only when every saturated prediction is within 20% and every run's
step within 25% (issue 33). Each ZeRO-Infinity run's profile (``deepspeed_compat.profile_zero_step``) is
printed beside the model's terms (``planner_accuracy.terms_markdown``).

Two predictions of the measured sweep, each engine's saturated tokens/s against the measured one:

* ``python -m ds_greedysnake.plan --saturated`` itself on the runs' ds_config and model over the
  micro-batch sizes and M that ran (``--micro-batch-sizes``, ``--micro-batches``, ``--json``): a probe of
  this machine that times the layers at those micro-batch sizes, and the planner's own choice of
  greedysnake's split and placement under the host budget. This is the issue's quantity. With
  ``--ab-json``, one call over every size, after all of them ran; with ``--run``, one call per size right
  after that size's runs, its points merged and reduced again (this machine's speed drifts: the same
  run measured 1033-1047 tokens/s at 02:00-02:30 and 1197 at 02:45 on 2026-12-02).
* every one-rank run predicted with the configuration it ran (``scripts/bench/planner_accuracy.py``: one probe
  per JSON), which tells a wrong model from a wrong choice.

The measured points and the second prediction go through the same reduction as ``--saturated``
(``ds_greedysnake.planner.saturation.saturation_of``): the best tokens/s per global batch, the plateau
(the best of the sweep) and the saturation point (the smallest global batch within 95% of it). Prints
the curves, each engine's predicted / measured plateau, and exits with status 1 when one of either
prediction is outside 0.8-1.2. A benchmark, never a test: the machine's rates drift between runs
(docs/planner.md).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))
sys.path.insert(0, os.path.join(REPO, "scripts", "bench", "ab_bench"))  # report_before_runs builds as ab_bench does

TOLERANCE = 0.2


def one_rank_runs(report: dict) -> list:
    """The runs of ``report`` the model predicts (one rank each), in the order of their rows."""
    return [run for run in report["runs"] if run.get("world_size", 1) == 1]


def points_of(report: dict, rows: list):
    """(measured, predicted) SweepPoints of the one-rank runs of ``report``, in the order of ``rows``."""
    from ds_greedysnake.planner.saturation import SweepPoint
    measured, predicted = [], []
    for run, row in zip(one_rank_runs(report), rows):
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


def plan_saturated(reports: list, nvme_path: str, plan_args=()) -> dict:
    """``python -m ds_greedysnake.plan --saturated --json`` on the runs' ds_config and model, over the
    micro-batch sizes and M that ran (``plan_args``: more of plan's arguments); its JSON."""
    runs = [run for report in reports for run in report["runs"] if run.get("world_size", 1) == 1]
    model = lambda report, run: {key: value for key, value in report["configs"][run["config"]].items()  # noqa: E731
                                 if key != "micro_batch_size"}
    spec = model(reports[0], runs[0])
    if any(model(report, run) != spec for report in reports for run in report["runs"]):
        raise SystemExit("the JSONs ran different models: one --saturated sweep covers one model")
    ds_config = dict(next(run for run in runs if run["engine"] == "greedysnake")["ds_config"])
    layers = (f"blocks={spec['layers']},hidden={spec['hidden']},heads={spec['heads']},vocab={spec['vocab']},"
              f"seq_len={spec['seq_len']}")
    sizes = sorted({run["micro_batch_size"] for run in runs})
    counts = sorted({run["micro_batches"] for run in runs})
    os.makedirs(nvme_path, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(ds_config, handle)
    command = [sys.executable, "-m", "ds_greedysnake.plan", "--config", handle.name, "--layers", layers, "--saturated",
               "--micro-batch-sizes", *map(str, sizes), "--micro-batches", *map(str, counts), "--json",
               "--nvme-path", nvme_path, *plan_args]
    print("$ " + " ".join(command), flush=True)
    try:
        done = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, text=True, check=True)
    finally:
        os.unlink(handle.name)
    return json.loads(done.stdout)


def against_plan(plan: dict, result: dict) -> dict:
    """engine -> the --saturated sweep's plateau and saturation point against the measured ones."""
    compared = {}
    for engine, saturation in plan["saturations"].items():
        measured = result[engine]["measured"]
        compared[engine] = {"plan_plateau": saturation["plateau"], "plan_saturation_point": saturation["saturation_point"],
                            "plan_curve": saturation["curve"],
                            "plateau_ratio": saturation["plateau"]["tokens_per_second"]
                            / measured["plateau"]["tokens_per_second"]}
    return compared


def plan_markdown(compared: dict, result: dict) -> str:
    lines = ["\nthe --saturated sweep (the planner's own greedysnake split and placement; one probe per call):",
             "| engine | measured saturated tokens/s (micro-batch x M; saturation point) | --saturated predicted "
             "(micro-batch x M; saturation point) | predicted / measured |", "|---|---|---|---|"]
    for engine, entry in compared.items():
        m, mk = result[engine]["measured"]["plateau"], result[engine]["measured"]["saturation_point"]
        p, pk = entry["plan_plateau"], entry["plan_saturation_point"]
        lines.append(f"| {engine} | {m['tokens_per_second']:.1f} ({m['micro_batch_size']} x {m['micro_batches']}; "
                     f"global batch {mk['global_batch']}) | {p['tokens_per_second']:.1f} ({p['micro_batch_size']} x "
                     f"{p['micro_batches']}; global batch {pk['global_batch']}) | {entry['plateau_ratio']:.2f} |")
    if len(compared) == 2:
        tokens = lambda point: point["tokens_per_second"]  # noqa: E731
        measured = tokens(result["greedysnake"]["measured"]["plateau"]) / tokens(result["zero_infinity"]["measured"]["plateau"])
        planned = tokens(compared["greedysnake"]["plan_plateau"]) / tokens(compared["zero_infinity"]["plan_plateau"])
        lines.append(f"saturated ratio greedysnake / ZeRO-Infinity: measured {measured:.2f}x, --saturated {planned:.2f}x")
    return "\n".join(lines)


AB_BASE_ARGS = "--quick --configs ssd_bound --ranks 1 --warmup 1 --steps 3 --no-plot --no-floors"
AB_ARGS = AB_BASE_ARGS + " --hidden 512 --layers 8 --seq-len 32"


def run_ab_bench(size: int, ab_args: str, out_dir: str, micro_batches, repeat=None) -> str:
    """One ab_bench invocation at micro-batch size ``size`` over ``micro_batches``; its JSON's path (with
    ``repeat``, the k-th of several: its own folder)."""
    out = os.path.join(out_dir, f"mbs{size}" if repeat is None else f"mbs{size}_r{repeat}")
    command = [sys.executable, os.path.join(REPO, "scripts", "bench", "ab_bench", "ab_bench.py"), *ab_args.split(),
               "--micro-batch-size", str(size), "--micro-batches", *map(str, micro_batches), "--out-dir", out]
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # each run's log: out/runs/
    return os.path.join(out, "ab_bench.json")


def median_report(reports: list) -> dict:
    """One ab_bench report from the same sweep run in several invocations (each run a fresh process): each
    one-rank run is the repeat whose median step is the median of theirs (the lower middle one for an even
    count), a whole record of one process, with every repeat's median step kept beside it
    (``step_seconds_by_repeat``). On this machine a process's disk rate is drawn with where its buffers land
    (docs/planner.md, "Why a run's disk rate moved"): the median of three is the run's usual step, where one
    process may be the other mode or the machine moving."""
    import statistics
    if len(reports) == 1:
        return reports[0]
    run_key = lambda run: (run["config"], run["engine"], run["micro_batches"], run.get("world_size", 1))  # noqa: E731
    keys = [run_key(run) for run in reports[0]["runs"]]
    for report in reports[1:]:
        other = [run_key(run) for run in report["runs"]]
        if other != keys:
            raise SystemExit(f"the repeats ran different sweeps: {keys} and {other}")
    runs = []
    for repeats in zip(*(report["runs"] for report in reports)):
        seconds = [repeat["step_seconds_median"] for repeat in repeats]
        chosen = seconds.index(statistics.median_low(seconds))
        runs.append(dict(repeats[chosen], step_seconds_by_repeat=seconds, repeat_chosen=chosen))
    return dict(reports[0], runs=runs, repeats=len(reports))


def merged_plan(plans: list) -> dict:
    """One --saturated result from several (one per micro-batch size, each probed right after its runs):
    every point of each, reduced again as the sweep reduces its own."""
    from ds_greedysnake.planner.saturation import SweepPoint, saturation_of
    merged = {"per_size": plans, "saturations": {}}
    for engine in plans[0]["saturations"]:
        points = [point for plan in plans for point in plan["saturations"][engine]["points"]]
        curve, plateau, knee = saturation_of([SweepPoint(p["engine"], p["micro_batch_size"], p["micro_batches"], p["ranks"],
                                                         p["tokens_per_second"], p["seconds"], p["binding"])
                                              for p in points])
        merged["saturations"][engine] = {"plateau": plateau.to_dict(), "saturation_point": knee.to_dict(),
                                         "curve": [p.to_dict() for p in curve], "points": points}
    return merged


def report_before_runs(size: int, ab_args: str, micro_batches) -> dict:
    """What ``plan_saturated`` reads of an ab_bench report, before its runs: the configurations and the
    greedysnake runs' ds_configs, built as ab_bench builds them."""
    import ab_bench
    from ab_bench_setup import ds_config, largest_param_numel
    args = ab_bench.parse_args([*ab_args.split(), "--micro-batch-size", str(size),
                                "--micro-batches", *map(str, micro_batches)])
    configs = ab_bench.configs_of(args)
    runs = [{"engine": "greedysnake", "config": name, "micro_batch_size": spec["micro_batch_size"], "micro_batches": m,
             "world_size": 1, "ds_config": ds_config(args.nvme_path, spec["micro_batch_size"], m, True,
                                                      largest_param_numel(spec))}
            for name, spec in configs.items() for m in ab_bench.sweep_of(args)]
    return {"configs": configs, "runs": runs}


def recorded_hardware(report: dict, plan):
    """config name -> the Hardware of ``plan``'s probe (None without a plan: ``predict_runs`` probes)."""
    if plan is None:
        return None
    from ds_greedysnake.planner import hardware_from_dict
    return {name: hardware_from_dict(plan["hardware"]) for name in report["configs"]}


def _both_bindings(before: str, after: str) -> str:
    """What bound under the probe before and the probe after: one name when they agree."""
    return after if before == after else f"{before} / {after}"


def bracketed_row(before: dict, after: dict) -> dict:
    """One run's row predicted from the probes before and after it: the geometric mean of the two step
    times (the phases, terms and bindings shown are the later probe's); both kept."""
    assert (before["engine"], before["micro_batches"]) == (after["engine"], after["micro_batches"])
    seconds = math.sqrt(before["predicted_seconds"] * after["predicted_seconds"])
    return dict(after, predicted_seconds=seconds, ratio=seconds / after["measured_seconds"],
                binding=_both_bindings(before["binding"], after["binding"]),
                predicted_seconds_before=before["predicted_seconds"], predicted_seconds_after=after["predicted_seconds"],
                ratio_after=after["ratio"])


def drift_markdown(rows: list) -> str:
    lines = ["| M | engine | measured s | predicted s, probe before / after | before / after | predicted / measured:"
             " after alone, both |", "|---|---|---|---|---|---|"]
    for row in rows:
        before, after = row["predicted_seconds_before"], row["predicted_seconds_after"]
        lines.append(f"| {row['micro_batches']} | {row['engine']} | {row['measured_seconds']:.3f} | {before:.3f} / "
                     f"{after:.3f} | {before / after:.2f} | {row['ratio_after']:.2f}, {row['ratio']:.2f} |")
    return "\n".join(lines)


def bracketed_plan(before: dict, after: dict) -> dict:
    """One ``--saturated`` result from the probes before and after a size's runs: each point's step the
    geometric mean of the two (the same configurations: what fits depends on memory, not on rates)."""
    combined = {"before": before, "after": after, "hardware": after["hardware"], "saturations": {}}
    for engine, saturation in after["saturations"].items():
        earlier = {(p["micro_batch_size"], p["micro_batches"], p["ranks"]): p
                   for p in before["saturations"][engine]["points"]}
        points = []
        for point in saturation["points"]:
            first = earlier.get((point["micro_batch_size"], point["micro_batches"], point["ranks"]))
            if first is None:
                raise SystemExit(f"the probes before and after the runs planned different {engine} configurations: "
                                 f"{point} only after")
            seconds = math.sqrt(first["seconds"] * point["seconds"])
            tokens = point["tokens_per_second"] * point["seconds"]
            points.append(dict(point, seconds=seconds, tokens_per_second=tokens / seconds,
                               binding=_both_bindings(first["binding"], point["binding"])))
        combined["saturations"][engine] = {"points": points}
    return combined


class Sweep:
    """One model's runs and both predictions: every one-rank run predicted with the configuration it ran
    (``planner_accuracy.predict_runs``) and, unless ``with_plan`` is off, ``plan --saturated`` over the runs'
    micro-batch sizes and M; with the plan, the per-run predictions use its probe (one probe per JSON).
    With ``bracket``, a second ``plan --saturated`` probes the machine right before each size's runs, and
    each prediction (per run and per point of the sweep) is the geometric mean of the two probes': this
    machine's disk moved 1.6-2x between probes minutes apart (docs/planner.md), and a run's ten minutes
    lie between the two. With ``repeats`` above 1, each size's ab_bench runs that many times between the
    probes and each run's measured step is the median of its repeats (``median_report``)."""

    def __init__(self, hardware: str, nvme_path: str, with_plan: bool, bracket: bool = False, plan_args=(),
                 repeats: int = 1):
        self.hardware, self.nvme_path, self.with_plan, self.bracket = hardware, nvme_path, with_plan, bracket
        self.plan_args, self.repeats = tuple(plan_args), repeats
        self.measured, self.predicted, self.per_json, self.plans = [], [], [], []

    def add(self, path: str, report: dict, plan=None, before=None) -> None:
        """Predict ``report``'s runs with the probe of ``plan`` (or this sweep's hardware); with the probe
        ``before`` the runs too, each run's prediction is the geometric mean of the two (``bracketed_row``)."""
        from planner_accuracy import markdown as rows_markdown, predict_runs
        rows, hardware = predict_runs(report, self.hardware, self.nvme_path, recorded=recorded_hardware(report, plan))
        entry = {"ab_json": os.path.abspath(path), "hardware": hardware}
        if before is not None:
            rows_before, entry["hardware_before"] = predict_runs(report, self.hardware, self.nvme_path,
                                                                 recorded=recorded_hardware(report, before))
            rows = [bracketed_row(first, last) for first, last in zip(rows_before, rows)]
            print(f"{path}: the probes before and after the runs\n{drift_markdown(rows)}", flush=True)
        for run, row in zip(one_rank_runs(report), rows):
            if "step_seconds_by_repeat" in run:
                row["measured_seconds_by_repeat"] = run["step_seconds_by_repeat"]
        print(f"{path}:\n{rows_markdown(rows)}", flush=True)
        more_measured, more_predicted = points_of(report, rows)
        self.measured.extend(more_measured)
        self.predicted.extend(more_predicted)
        entry["rows"] = rows
        self.per_json.append(entry)

    def run(self, sizes, ab_args: str, out_dir: str, micro_batches) -> None:
        """Each size's ab_bench runs, then its predictions, probed right after they ran (and, with
        ``bracket``, right before too)."""
        for size in sizes:
            before = None
            if self.with_plan and self.bracket:
                before = plan_saturated([report_before_runs(size, ab_args, micro_batches)], self.nvme_path,
                                        self.plan_args)
            path, report = self.run_repeats(size, ab_args, out_dir, micro_batches)
            after = plan_saturated([report], self.nvme_path, self.plan_args) if self.with_plan else None
            if after is not None:
                self.plans.append(after if before is None else bracketed_plan(before, after))
            self.add(path, report, after, before)

    def run_repeats(self, size: int, ab_args: str, out_dir: str, micro_batches):
        """(path, report) of size ``size``'s runs: one ab_bench, or ``repeats`` of them merged by
        ``median_report`` (written beside them)."""
        if self.repeats == 1:
            path = run_ab_bench(size, ab_args, out_dir, micro_batches)
            with open(path) as handle:
                return path, json.load(handle)
        reports = []
        for repeat in range(self.repeats):
            with open(run_ab_bench(size, ab_args, out_dir, micro_batches, repeat)) as handle:
                reports.append(json.load(handle))
        path = os.path.join(out_dir, f"mbs{size}_median.json")
        report = median_report(reports)
        with open(path, "w") as handle:
            json.dump(report, handle, indent=1)
        return path, report

    def verdict(self):
        """(result, compared with the plan or None, whether every saturated prediction is within TOLERANCE,
        the largest per-run error)."""
        result = compare(self.measured, self.predicted)
        within = lambda ratio: 1 - TOLERANCE <= ratio <= 1 + TOLERANCE  # noqa: E731
        ok = all(within(curves["plateau_ratio"]) for curves in result.values())
        compared = None
        if self.plans:
            compared = against_plan(merged_plan(self.plans), result)
            ok = ok and all(within(entry["plateau_ratio"]) for entry in compared.values())
        worst = max(abs(row["ratio"] - 1) for entry in self.per_json for row in entry["rows"])
        return result, compared, ok, worst


def parse_shape(text: str) -> dict:
    """HIDDEN:LAYERS:SEQ_LEN -> ab_bench's overrides."""
    try:
        hidden, layers, seq_len = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes takes HIDDEN:LAYERS:SEQ_LEN (e.g. 640:6:40), got {text!r}") from None
    if min(hidden, layers, seq_len) < 1:
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: every number must be positive")
    return {"hidden": hidden, "layers": layers, "seq_len": seq_len}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ab-json", nargs="+", help="ab_bench.json files (one micro-batch size each), already run")
    source.add_argument("--run", type=int, nargs="+", metavar="MBS",
                        help="run the sweep here: one ab_bench per micro-batch size, each predicted right after it "
                             "ran (this machine's speed drifts by 10-20%% within half an hour)")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=None, metavar="H:L:S",
                        help="with --run: one sweep per model shape (hidden:blocks:tokens per sequence, ab_bench's "
                             "ssd_bound otherwise), each its own verdict; per-run steps must be within 25%%")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="with --run: the M")
    parser.add_argument("--ab-args", default=AB_ARGS, help="with --run: ab_bench's other arguments")
    parser.add_argument("--out-dir", default=os.path.join(REPO, "results", "saturation"), help="with --run")
    parser.add_argument("--hardware", default="probe", help="'probe' (once per JSON) or a hardware JSON file")
    parser.add_argument("--nvme-path", default=os.path.join(REPO, ".nvme_swap", "planner_probe"))
    parser.add_argument("--no-plan", action="store_true", help="skip the --saturated sweep (per-run predictions only)")
    parser.add_argument("--probe-after-only", action="store_true",
                        help="with --run: probe only after each size's runs (by default also right before them, "
                             "and each prediction is the geometric mean of the two probes')")
    parser.add_argument("--zero-probe-processes", type=int, default=1, metavar="N",
                        help="plan's ZeRO-3 probe in N processes, each term the mean of theirs (plan's own option)")
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="with --run: each size's ab_bench N times between its probes, each run's step the "
                             "median of its N processes' (every repeat's kept and counted alone too)")
    parser.add_argument("--out", default=None, help="write the curves, rows and probes as JSON here")
    args = parser.parse_args(argv)
    if args.zero_probe_processes < 1:
        parser.error(f"--zero-probe-processes must be at least 1, got {args.zero_probe_processes}")
    if args.shapes and not args.run:
        parser.error("--shapes needs --run MBS ...")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.repeats > 1 and not args.run:
        parser.error(f"--repeats {args.repeats} needs --run MBS ... (--ab-json's runs already ran once each)")
    with_plan = args.hardware == "probe" and not args.no_plan
    if args.shapes:
        os._exit(run_shapes(args, with_plan))
    huge_pages = transparent_hugepages()
    sweep = Sweep(args.hardware, args.nvme_path, with_plan, bracket=not args.probe_after_only,
                  plan_args=plan_args(args), repeats=args.repeats)
    if args.run:
        sweep.run(args.run, args.ab_args, args.out_dir, args.micro_batches)
    else:
        reports = []
        for path in args.ab_json:
            with open(path) as handle:
                reports.append(json.load(handle))
        if with_plan:
            sweep.plans.append(plan_saturated(reports, args.nvme_path, plan_args(args)))
        for path, report in zip(args.ab_json, reports):
            sweep.add(path, report)
    result, compared, ok, _ = sweep.verdict()
    print(markdown(result))
    if compared is not None:
        print(plan_markdown(compared, result))
    print(f"\nevery engine's predicted saturated tokens/s within {100 * TOLERANCE:.0f}% of the measured "
          f"({'--saturated and ' if compared is not None else ''}per run): {'yes' if ok else 'NO'}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"engines": result, "runs": sweep.per_json, "plan_saturated": merged_plan(sweep.plans)
                       if sweep.plans else None, "against_plan": compared, "transparent_hugepages": huge_pages},
                      handle, indent=1)
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # DeepSpeed's native threads have aborted at interpreter exit here


RUN_TOLERANCE = 0.25


def plan_args(args) -> tuple:
    """plan's arguments beyond the sweep's own, from this script's."""
    return ("--zero-probe-processes", str(args.zero_probe_processes)) if args.zero_probe_processes != 1 else ()

THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_hugepages(path: str = THP_SETTING):
    """The kernel's transparent huge page mode ("always", "madvise" or "never"; None where it cannot be read),
    recorded with the results: on this virtual machine it moved both engines' terms (docs/planner.md, "Why a
    run's disk rate moved"). Under "madvise" a process's locked aio buffers are 4 KiB pages, and where they
    land in memory fragmented by earlier processes, reads into them ran at 1.3-1.5 GB/s against 2.7-2.9;
    under "always" every buffer read fast, but ZeRO-3's gradient reductions in the planner's small probe
    process ran 2-3x faster than in the runs."""
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else None


def runs_outside(rows: list, key: str):
    """How many of ``rows`` have ``key`` (a predicted / measured ratio) outside RUN_TOLERANCE; None where a
    row has none (``ratio_after``: only with the probe before the runs)."""
    if not all(key in row for row in rows):
        return None
    return sum(abs(row[key] - 1) > RUN_TOLERANCE for row in rows)


def runs_outside_by_repeat(rows: list):
    """Per repeat, how many of ``rows`` its process alone puts outside RUN_TOLERANCE (the prediction against
    that repeat's step); None without repeats."""
    if not rows or not all("measured_seconds_by_repeat" in row for row in rows):
        return None
    count = len(rows[0]["measured_seconds_by_repeat"])
    return [sum(abs(row["predicted_seconds"] / row["measured_seconds_by_repeat"][k] - 1) > RUN_TOLERANCE
                for row in rows) for k in range(count)]


def summary_markdown(summary: list) -> str:
    """The table of every shape: per engine the saturated tokens/s measured and predicted, the worst run and
    how many runs lie outside 25% (after the probe alone; with repeats, against each repeat alone)."""
    lines = ["| shape | engine | measured saturated tokens/s (micro-batch x M) | --saturated predicted (micro-batch x M) "
             "| predicted / measured | worst run: M, measured / predicted s, ratio (binds) | runs outside 25% "
             "(the probe after alone) | against each repeat alone |", "|---|---|---|---|---|---|---|---|"]
    for item in summary:
        m, p, w = item["measured"], item["plan"], item["worst_run"]
        alone = "-" if item["runs_outside_after_probe_alone"] is None else item["runs_outside_after_probe_alone"]
        by_repeat = item.get("runs_outside_by_repeat")
        repeats = "-" if by_repeat is None else ", ".join(map(str, by_repeat))
        planned = (f"{p['tokens_per_second']:.1f} ({p['micro_batch_size']} x {p['micro_batches']})" if p else "-")
        ratio = f"{item['plan_ratio']:.2f}" if item["plan_ratio"] is not None else f"{item['per_run_ratio']:.2f}"
        lines.append(f"| {item['shape']} | {item['engine']} | {m['tokens_per_second']:.1f} ({m['micro_batch_size']} x "
                     f"{m['micro_batches']}) | {planned} | {ratio} | M={w['micro_batches']}, "
                     f"{w['measured_seconds']:.3f} / {w['predicted_seconds']:.3f}, {w['ratio']:.2f} ({w['binding']}) | "
                     f"{item['runs_outside']} of {item['runs']} ({alone}) | {repeats} |")
    return "\n".join(lines)


def run_shapes(args, with_plan: bool) -> int:
    """Every shape's sweep in turn, each shape's tables as it ends, then one summary table: per shape and
    engine, the saturated tokens/s measured and predicted (``--saturated``) and the largest per-run error.
    Exit status 0 only when every saturated prediction is within 20% and every run within 25%."""
    summary, everything, all_ok = [], [], True
    huge_pages = transparent_hugepages()
    print(f"transparent huge pages: {huge_pages} ({THP_SETTING}; docs/planner.md, \"Why a run's disk rate moved\")",
          flush=True)
    for shape in args.shapes:
        label = f"hidden {shape['hidden']}, {shape['layers']} blocks, {shape['seq_len']} tokens"
        print(f"\n## {label}", flush=True)
        base = AB_BASE_ARGS if args.ab_args == AB_ARGS else args.ab_args
        ab_args = f"{base} --hidden {shape['hidden']} --layers {shape['layers']} --seq-len {shape['seq_len']}"
        out_dir = os.path.join(args.out_dir, f"h{shape['hidden']}_l{shape['layers']}_s{shape['seq_len']}")
        sweep = Sweep(args.hardware, args.nvme_path, with_plan, bracket=not args.probe_after_only,
                      plan_args=plan_args(args), repeats=args.repeats)
        sweep.run(args.run, ab_args, out_dir, args.micro_batches)
        result, compared, ok, _ = sweep.verdict()
        print(markdown(result))
        if compared is not None:
            print(plan_markdown(compared, result))
        for engine, curves in result.items():
            rows = [row for entry in sweep.per_json for row in entry["rows"] if row["engine"] == engine]
            worst = max(rows, key=lambda row: abs(row["ratio"] - 1))
            plan_ratio = compared[engine]["plateau_ratio"] if compared else None
            summary.append({"shape": label, "engine": engine,
                            "measured": curves["measured"]["plateau"], "per_run_ratio": curves["plateau_ratio"],
                            "plan": compared[engine]["plan_plateau"] if compared else None, "plan_ratio": plan_ratio,
                            "worst_run": {k: worst[k] for k in ("micro_batches", "measured_seconds",
                                                                 "predicted_seconds", "ratio", "binding")},
                            "worst_run_size": next(entry for entry in sweep.per_json if worst in entry["rows"])
                            ["ab_json"]})
            summary[-1].update(runs=len(rows), runs_outside=runs_outside(rows, "ratio"),
                               runs_outside_after_probe_alone=runs_outside(rows, "ratio_after"),
                               runs_outside_by_repeat=runs_outside_by_repeat(rows))
            all_ok = all_ok and abs(worst["ratio"] - 1) <= RUN_TOLERANCE
        all_ok = all_ok and ok
        everything.append({"shape": shape, "engines": result, "runs": sweep.per_json,
                           "plan_saturated": merged_plan(sweep.plans) if sweep.plans else None,
                           "against_plan": compared})
    print("\n## Every shape\n")
    print(summary_markdown(summary))
    print(f"\nevery saturated prediction within {100 * TOLERANCE:.0f}% and every run within "
          f"{100 * RUN_TOLERANCE:.0f}%: {'yes' if all_ok else 'NO'}", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"shapes": everything, "summary": summary, "transparent_hugepages": huge_pages}, handle,
                      indent=1)
    sys.stdout.flush()
    return 0 if all_ok else 1


if __name__ == "__main__":
    main()
