"""A/B benchmark: DeepSpeed's ZeRO-Infinity against greedysnake on the same model, data and ds_config.

    python scripts/bench/ab_bench/ab_bench.py --quick                 # a few minutes on 2 cores (small sizes, M in 1 4)
    python scripts/bench/ab_bench/ab_bench.py                         # the default sweep (see docs/ab_bench.md for its time)
    python scripts/bench/ab_bench/ab_bench.py --configs ssd_bound --micro-batches 1 2 4 8

For every configuration (model size, micro-batch size) and every gradient-accumulation count M, each
engine runs in its own subprocess (DeepSpeed's zero.Init replaces torch.nn.functional.linear for the
whole process), one after the other, and reports as JSON: the median step time after warm-up,
tokens/s, SSD bytes read and written per step (greedysnake: its aio-layer counters, the optimizer
worker's included; ZeRO-Infinity: its parameter swap reads, and the process's /proc/self/io for all of
it), the process's own /proc/self/io for both, the peak RSS per process and the losses. A further
subprocess measures the machine (SSD read and write rates through DeepSpeed's aio handle, CPU Adam
elements/s, the model's forward and backward time per micro-batch) for the roofline.

The parent writes <out-dir>/ab_bench.json (everything, the ds_configs included), ab_bench.md (the
table) and ab_bench.png (tokens/s against global batch, both engines, with the rooflines).
"""
import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_bench_report import markdown, plot, plot_time, roofline  # noqa: E402
from ab_bench_setup import (AIO, CONFIGS, DEFAULT_CONFIGS, ENGINES, QUICK_CONFIGS, REPO, free_port,  # noqa: E402
                            remove_shm_buffers)

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ab_bench_child.py")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small models, M in 1 4, 1 warm-up + 2 measured steps, smaller roofline probes")
    parser.add_argument("--configs", nargs="+", default=None, choices=sorted(CONFIGS))
    parser.add_argument("--micro-batches", type=int, nargs="+", default=None, help="the sweep of M (default 1 2 4 8)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="override every configuration's")
    parser.add_argument("--hidden", type=int, default=None, help="override every configuration's hidden size")
    parser.add_argument("--layers", type=int, default=None, help="override every configuration's block count")
    parser.add_argument("--seq-len", type=int, default=None, help="override every configuration's tokens per sequence")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 4, quick 2)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--nvme-path", default=os.path.join(REPO, ".nvme_swap", "ab_bench"),
                        help="folder on a disk-backed filesystem (not tmpfs); each run gets a fresh subfolder")
    parser.add_argument("--out-dir", default=os.path.join(REPO, "results", "ab_bench"))
    parser.add_argument("--child-timeout", type=int, default=1800, help="seconds per engine run")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--greedysnake-options", type=json.loads, default={}, metavar="JSON",
                        help='keys merged into greedysnake\'s "greedysnake" block, e.g. \'{"optimizer_read_ahead_mb": 256}\'')
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write the Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev) of one greedysnake "
                             "step, its median one, to FILE; with several greedysnake runs, one file each, named "
                             "FILE's stem + _<run>.json")
    parser.add_argument("--no-floors", action="store_true",
                        help="skip greedysnake's floors (the I/O replay, compute and Adam alone after each one-rank "
                             "run): a sweep over many configurations in less time; the step times are unchanged")
    parser.add_argument("--busy-cores", type=int, default=0, metavar="N",
                        help="also run every engine beside N processes that each keep a core busy (a data loader, "
                             "a tokenizer), after its run alone; the report gives both and the slow-down")
    parser.add_argument("--ranks", type=int, nargs="+", default=None,
                        help="data-parallel world sizes to run (default: 1 for every M, and 2 at the largest M "
                             "of each configuration; --quick: 1)")
    return parser.parse_args(argv)


def run_child(kind: str, spec: dict, args, log_name: str, world_size: int = 1) -> dict:
    """Run one child (one process per rank, with the launcher's environment) and return its merged result."""
    os.makedirs(os.path.join(args.out_dir, "runs"), exist_ok=True)
    spec_path = os.path.join(args.out_dir, "runs", log_name + ".spec.json")
    result_path = os.path.join(args.out_dir, "runs", log_name + ".json")
    spec = dict(spec, kind=kind, result_path=result_path)
    with open(spec_path, "w") as handle:
        json.dump(spec, handle)
    started = time.time()
    attempts = []
    for attempt in range(2):  # one retry: a child has died of a native abort on this machine
        exit_codes = _launch_ranks(spec_path, spec, args, log_name, world_size)
        attempts.append(exit_codes)
        paths = [_rank_path(result_path, rank, world_size) for rank in range(world_size)]
        if all(code == 0 for code in exit_codes) and all(os.path.exists(path) for path in paths):
            break
        log_path = os.path.join(args.out_dir, "runs", log_name + ".log")
        with open(log_path) as log:
            tail = log.read()[-1500:]
        os.replace(log_path, f"{log_path}.failed{attempt}")
        print(f"  {log_name} failed (exits {exit_codes}), log {log_path}.failed{attempt}:\n{tail}", flush=True)
    else:
        raise RuntimeError(f"{log_name} failed twice (exits {attempts}); logs under {args.out_dir}/runs")
    results = []
    for path in paths:
        with open(path) as handle:
            results.append(json.load(handle))
    result = merge_ranks(results) if kind == "engine" else results[0]
    result["child_wall_seconds"] = time.time() - started
    result["child_exit_codes"] = attempts
    print(f"  {log_name}: {result['child_wall_seconds']:.0f}s", flush=True)
    return result


def _rank_path(result_path: str, rank: int, world_size: int) -> str:
    return result_path if world_size == 1 else result_path.replace(".json", f".rank{rank}.json")


def _launch_ranks(spec_path: str, spec: dict, args, log_name: str, world_size: int):
    """Every rank as `deepspeed --num_gpus N` would start it; rank 0's output goes to the log."""
    port = free_port()
    log_path = os.path.join(args.out_dir, "runs", log_name + ".log")
    processes = []
    try:
        with open(log_path, "w") as log:
            for rank in range(world_size):
                env = dict(os.environ, MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                           WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
                output = log if rank == 0 else subprocess.DEVNULL
                processes.append(subprocess.Popen([sys.executable, CHILD, spec_path], stdout=output,
                                                  stderr=subprocess.STDOUT, env=env, cwd=REPO))
            deadline = time.time() + args.child_timeout
            for process in processes:
                try:
                    process.wait(timeout=max(1.0, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    pass
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        remove_shm_buffers(port)
        if spec.get("nvme_path"):
            shutil.rmtree(spec["nvme_path"], ignore_errors=True)
    return [process.returncode for process in processes]


@contextlib.contextmanager
def busy_cores(count: int):
    """``count`` processes, each spinning on a core, for as long as the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def trace_path(trace: str, label: str, only_run: bool):
    """Where ``--trace`` FILE puts a run's Chrome trace: FILE itself for the invocation's only greedysnake run
    on one rank, else FILE's stem + _<label>.json."""
    stem, extension = os.path.splitext(trace)
    return trace if only_run else f"{stem}_{label}{extension or '.json'}"


def merge_ranks(results: list) -> dict:
    """One run's result from its ranks: rank 0's timings, SSD bytes summed over the ranks (one SSD),
    the largest per-process peak RSS (and the sum), the mean of the ranks' losses."""
    merged = dict(results[0])
    merged["world_size"] = len(results)
    for key in ("ssd_read_bytes_per_step", "ssd_write_bytes_per_step", "param_read_bytes_per_step",
                "proc_read_bytes_per_step", "proc_write_bytes_per_step", "worker_read_bytes_per_step",
                "worker_write_bytes_per_step"):
        if key in merged:
            merged[key] = sum(result[key] for result in results)
    merged["peak_rss_mib"] = max(result["peak_rss_mib"] for result in results)
    merged["peak_rss_children_mib"] = max(result["peak_rss_children_mib"] for result in results)
    merged["peak_rss_mib_all_ranks"] = sum(r["peak_rss_mib"] + r["peak_rss_children_mib"] for r in results)
    merged["losses"] = [sum(values) / len(values) for values in zip(*(result["losses"] for result in results))]
    merged["final_loss"] = merged["losses"][-1]
    return merged


def cells(configs: dict, sweep: list, args):
    """(config name, spec, M, world size) of every run pair, in order."""
    for name, model_spec in configs.items():
        for m in sweep:
            if args.ranks:
                sizes = args.ranks
            else:
                sizes = [1] if args.quick or m != max(sweep) else [1, 2]
            for world_size in sizes:
                yield name, model_spec, m, world_size


def runs_in_order(configs: dict, sweep: list, args):
    """(config name, spec, M, world size, engine, busy cores) of every run: each engine alone, then (with
    ``--busy-cores``) beside the busy processes, one after the other."""
    for name, model_spec, m, world_size in cells(configs, sweep, args):
        for engine in args.engines:
            for busy in ([0, args.busy_cores] if args.busy_cores else [0]):
                yield name, model_spec, m, world_size, engine, busy


def configs_of(args) -> dict:
    """config name -> model spec of the configurations ``args`` runs, their overrides applied."""
    base = QUICK_CONFIGS if args.quick else CONFIGS
    configs = {name: dict(base[name]) for name in (args.configs or DEFAULT_CONFIGS)}
    for spec in configs.values():
        for key, value in (("micro_batch_size", args.micro_batch_size), ("hidden", args.hidden), ("layers", args.layers),
                           ("seq_len", args.seq_len)):
            if value is not None:
                spec[key] = value
    return configs


def sweep_of(args) -> list:
    """The M ``args`` runs."""
    return args.micro_batches or ([1, 4] if args.quick else [1, 2, 4, 8])


def main(argv=None):
    args = parse_args(argv)
    began = time.time()
    configs = configs_of(args)
    sweep = sweep_of(args)
    if args.trace and ("greedysnake" not in args.engines
                       or not any(world_size == 1 for *_, world_size in cells(configs, sweep, args))):
        raise SystemExit(f"--trace {args.trace}: only a greedysnake run on one rank is traced, and this invocation "
                         "has none: add greedysnake to --engines, or 1 to --ranks")
    if args.trace and args.no_floors:
        raise SystemExit(f"--trace {args.trace} is written from the floors' recording: drop --no-floors")
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (2 if args.quick else 4)
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(args.nvme_path, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="run_", dir=args.nvme_path)
    print(f"A/B benchmark: configs {list(configs)}, M in {sweep}, {warmup} warm-up + {steps} measured steps; "
          f"SSD folder {scratch}", flush=True)
    try:
        machine_spec = {"nvme_path": os.path.join(scratch, "roofline"), "configs": configs,
                        "ssd_region_mib": 64 if args.quick else 256, "ssd_repeats": 3 if args.quick else 5,
                        "adam_numel": (1 << 23) if args.quick else (1 << 24),
                        "compute_repeats": 4 if args.quick else 6, "micro_batches": sweep}
        machine = run_child("machine", machine_spec, args, "machine")
        runs = []
        # The SSD's rates drift on this machine (up to 1.9x within seconds): each run also gets a roofline
        # from the rates measured right before and right after it.
        ssd_probe = {"ssd_region_mib": machine_spec["ssd_region_mib"], "ssd_repeats": 3}
        probe_count = 0

        def probe_ssd() -> dict:
            nonlocal probe_count
            probe_count += 1
            return run_child("ssd", dict(ssd_probe, nvme_path=os.path.join(scratch, f"ssd{probe_count}")), args,
                             f"ssd_probe{probe_count}")

        rates_before = probe_ssd()
        one_rank_runs = sum(1 for *_, world_size in cells(configs, sweep, args) if world_size == 1)
        for name, model_spec, m, world_size, engine, busy in runs_in_order(configs, sweep, args):
            label = (f"{name}_m{m}" + (f"_ranks{world_size}" if world_size > 1 else "") + f"_{engine}"
                     + (f"_busy{busy}" if busy else ""))
            spec = {"engine": engine, "config": name, "model": model_spec, "micro_batches": m,
                    "greedysnake_options": args.greedysnake_options, "floors": not args.no_floors and not busy,
                    "trace_path": (trace_path(args.trace, label, one_rank_runs == 1)
                                   if args.trace and engine == "greedysnake" and world_size == 1 and not busy
                                   else None),
                    "warmup": warmup, "steps": steps, "seed": 0, "nvme_path": os.path.join(scratch, label)}
            with busy_cores(busy):
                run = run_child("engine", spec, args, label, world_size)
            run["busy_cores"] = busy
            rates_after = probe_ssd()
            run["ssd_rates_around_run"] = {"before": rates_before, "after": rates_after}
            run["roofline"] = roofline(run, machine, model_spec, (rates_before, rates_after))
            runs.append(run)
            rates_before = rates_after
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    agreement = []
    for name, _, m, world_size in cells(configs, sweep, args):
        pair = {r["engine"]: r["final_loss"] for r in runs if r["config"] == name and r["micro_batches"] == m
                and r.get("world_size", 1) == world_size and not r["busy_cores"]}
        if len(pair) == 2:
            agreement.append({"config": name, "micro_batches": m, "world_size": world_size, **pair,
                              "relative_difference": abs(pair["greedysnake"] - pair["zero_infinity"])
                              / abs(pair["zero_infinity"])})
    report = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(began)), "quick": args.quick,
        "wall_seconds": None, "greedysnake_options": args.greedysnake_options, "warmup": warmup, "steps": steps,
        "sweep": sweep, "configs": configs, "busy_cores": args.busy_cores,
        "machine": machine, "runs": runs, "loss_agreement": agreement,
        "baseline": {
            "description": "ZeRO-Infinity: stage 3, parameters and optimizer states on NVMe, max_in_cpu 0, "
                           "DeepSpeed activation checkpointing around every block (deepspeed.checkpointing, exact; "
                           "torch.utils.checkpoint is not with NVMe parameters on 0.19.8); model built under zero.Init",
            "aio": AIO, "offload_param_max_in_cpu": 0, "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 100000, "sub_group_size": 1,
            "notes": "ZeRO-3 swaps to NVMe only tensors of at least 1 MiB; smaller ones stay in host memory",
        },
        "peak_rss_note": "ru_maxrss per process; greedysnake's optimizer worker is a separate process, reported "
                         "as peak_rss_children_mib",
    }
    report["wall_seconds"] = time.time() - began
    with open(os.path.join(args.out_dir, "ab_bench.json"), "w") as handle:
        json.dump(report, handle, indent=1)
    table = markdown(report)
    with open(os.path.join(args.out_dir, "ab_bench.md"), "w") as handle:
        handle.write(table)
    print("\n" + table)
    if not args.no_plot:
        plot(report, os.path.join(args.out_dir, "ab_bench.png"))
        print(f"plot: {os.path.join(args.out_dir, 'ab_bench.png')}")
        if any("floors" in run for run in runs):
            plot_time(report, os.path.join(args.out_dir, "ab_bench_time.png"))
            print(f"where the time goes: {os.path.join(args.out_dir, 'ab_bench_time.png')}")
    print(f"total {report['wall_seconds']:.0f}s; JSON {os.path.join(args.out_dir, 'ab_bench.json')}")


if __name__ == "__main__":
    main()
