"""Where ZeRO-3's gradient reduction spends its time: ab_bench's ZeRO-Infinity runs of one shape, their
reductions profiled part by part (``deepspeed_compat.profile_zero_step``: the bucket's reduce-scatter, the
partitions' copies, the boundary's norms, the rest), against the planner's ZeRO-3 probe of the same shape
(``zero_probe``, four blocks, M=2) run right before and right after them, in one invocation. Issue 33's
hidden-848 runs reduced 1.5-2x slower than probed; this is how that was looked into (docs/planner.md,
"Hidden 848's reduction, profiled"). A benchmark: it prints what it measured, no verdict.

    python scripts/bench/zero_reduction_profile.py --shape 848:9:24 --micro-batch-size 1 --micro-batches 1 4

Each run is a fresh process (ab_bench's child); nanoseconds per element of a micro-batch's gradients, the
boundary's norms per element of the model. ``reduction`` is what the planner's term covers (the reduction less
the boundary's gradient write), averaged over the step's micro-batches, with the probe's prediction of it.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(HERE, "ab_bench"))

PARTS = ("reduce-scatter", "partition copies", "rest", "norm (boundary)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, metavar="HIDDEN:LAYERS:SEQ_LEN", help="e.g. 848:9:24")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--probe-processes", type=int, default=1, help="the ZeRO-3 probe's processes, before and after")
    parser.add_argument("--out-dir", default=os.path.join(REPO, "results", "zero_reduction_profile"))
    args = parser.parse_args(argv)
    try:
        args.hidden, args.layers, args.seq_len = (int(part) for part in args.shape.split(":"))
    except ValueError:
        parser.error(f"--shape takes HIDDEN:LAYERS:SEQ_LEN (e.g. 848:9:24), got {args.shape!r}")
    if min(args.hidden, args.layers, args.seq_len, args.micro_batch_size, *args.micro_batches) < 1:
        parser.error("every number of --shape, --micro-batch-size and --micro-batches must be positive")
    return args


def ab_args(args) -> list:
    return ["--quick", "--configs", "ssd_bound", "--ranks", "1", "--warmup", "1", "--steps", "3", "--no-plot",
            "--no-floors", "--engines", "zero_infinity", "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size)]


def predicted_reduction(terms: dict, micro_batches: int) -> float:
    """The planner's reduction term per element of a micro-batch at M, from the probe's terms."""
    from ds_greedysnake.planner.cost_model import zero_reduce_seconds_per_element
    return zero_reduce_seconds_per_element(1.0 / terms["zero_grad_reduce_elements_per_s"],
                                           terms["zero_optimizer_seconds_per_element"]["gradient reduction (boundary)"],
                                           micro_batches)


def run_rows(report: dict) -> list:
    """Per ZeRO-Infinity run of an ab_bench report: its reduction's parts and the reduction the term covers,
    seconds per element."""
    from ds_greedysnake.planner.zero_probe import reduction_parts
    rows = []
    for run in report["runs"]:
        if run["engine"] != "zero_infinity":
            continue
        ops, m, params = run["seconds_by_op_mean"], run["micro_batches"], run["parameters"]
        rows.append({"micro_batches": m, "step_seconds": run["step_seconds_median"],
                     "parts": reduction_parts(ops, m, params),
                     "reduction": (ops["gradient reduction"] - ops["gradient write (boundary)"]) / (m * params)})
    return rows


def table(probes: list, rows: list) -> str:
    """The probes' and the runs' parts side by side, and each run's reduction against both probes'."""
    nanos = lambda seconds: f"{seconds * 1e9:.2f}"  # noqa: E731
    lines = ["| | " + " | ".join(PARTS) + " | reduction (term) | predicted / measured |",
             "|---" * (len(PARTS) + 3) + "|"]
    for label, terms in probes:
        parts = terms["zero_reduction_parts_seconds_per_element"]
        lines.append(f"| probe {label} (M=2) | " + " | ".join(nanos(parts[name]) for name in PARTS)
                     + f" | {nanos(predicted_reduction(terms, 2))} | |")
    for row in rows:
        m = row["micro_batches"]
        ratios = " / ".join(f"{predicted_reduction(terms, m) / row['reduction']:.2f}" for _, terms in probes)
        lines.append(f"| run M={m} (step {row['step_seconds']:.2f} s) | "
                     + " | ".join(nanos(row["parts"][name]) for name in PARTS)
                     + f" | {nanos(row['reduction'])} | {ratios} |")
    return "\n".join(lines)


def probe(args, folder: str) -> dict:
    import ab_bench
    from ab_bench_setup import ds_config, largest_param_numel
    from ds_greedysnake.planner.cost_model import Workload
    from ds_greedysnake.planner.shapes import GPTShape
    from ds_greedysnake.planner.zero_probe import probe_zero_engine

    spec = ab_bench.configs_of(ab_bench.parse_args(ab_args(args)))["ssd_bound"]
    shape = GPTShape("profiled", args.layers, args.hidden, spec["heads"], spec["vocab"], args.seq_len)
    ds = ds_config(folder, args.micro_batch_size, 2, False, largest_param_numel(spec))
    return probe_zero_engine(ds, Workload(shape, args.micro_batch_size, 2), folder, processes=args.probe_processes)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    nvme = os.path.join(REPO, ".nvme_swap")
    os.makedirs(nvme, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zero_reduction_", dir=nvme) as folder:
        before = probe(args, folder)
        command = [sys.executable, os.path.join(HERE, "ab_bench", "ab_bench.py"), *ab_args(args),
                   "--micro-batches", *map(str, args.micro_batches), "--out-dir", args.out_dir]
        print("$ " + " ".join(command), flush=True)
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        after = probe(args, folder)
    with open(os.path.join(args.out_dir, "ab_bench.json")) as handle:
        rows = run_rows(json.load(handle))
    result = {"shape": args.shape, "micro_batch_size": args.micro_batch_size, "probe_before": before,
              "probe_after": after, "runs": rows}
    with open(os.path.join(args.out_dir, "zero_reduction_profile.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"\nhidden {args.hidden}, {args.layers} blocks, {args.seq_len} tokens, micro-batch {args.micro_batch_size}: "
          "ns per element\n")
    print(table([("before", before), ("after", after)], rows))
    measured = [row["reduction"] for row in rows]
    print(f"\nruns' reduction {min(measured) * 1e9:.2f}-{max(measured) * 1e9:.2f} ns/element; probes' (M=2) "
          f"{statistics.fmean(predicted_reduction(t, 2) for t in (before, after)) * 1e9:.2f} on average")


if __name__ == "__main__":
    main()
