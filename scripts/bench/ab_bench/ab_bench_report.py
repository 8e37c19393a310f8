"""The A/B benchmark's report: the roofline of each run, the markdown tables and the plot."""
from ab_bench_setup import LABELS, MIB


def best_compute(compute: dict, num_micro_batches: int) -> dict:
    """Seconds per micro-batch of forward and of forward+backward: the faster of the whole-model pass
    and the vertical order at this M, each term on its own (the roofline is the best the machine does)."""
    vertical = compute.get("vertical", {}).get(str(num_micro_batches), {})
    return {key: min(compute[key], vertical.get(key, compute[key])) for key in ("forward_s", "forward_backward_s")}


def streaming_compute(compute: dict, num_micro_batches: int) -> dict:
    """Seconds per micro-batch in the vertical order while the SSD streams (see ab_bench_child); falls back
    to ``best_compute`` when the probe did not measure this M."""
    streaming = compute.get("vertical_streaming", {}).get(str(num_micro_batches))
    return streaming if streaming is not None else best_compute(compute, num_micro_batches)


def roofline(run: dict, machine: dict, model_spec: dict, rates_around_run=()) -> dict:
    """The best step time the machine allows for this run's measured SSD volume and compute.

    CPU work (forward, recompute and backward of every micro-batch, and Adam over every parameter)
    shares the same cores, so it adds up; SSD transfers run on the aio threads and can overlap the CPU
    work, but reads and writes share the SSD. Bound = max(CPU time, SSD time).

    ``rates_around_run``: SSD probes taken right before and right after this run (``measure_ssd_rates``);
    the same bound with the faster of their rates is the ``around_run`` one."""
    compute = best_compute(machine["compute"][run["config"]], run["micro_batches"])
    # Every rank's micro-batches share this machine's cores (one process per rank).
    m = run["micro_batches"] * run.get("world_size", 1)
    # Adam and optimizer states for the trainable parameters only (a LoRA run's adapters); the compute is
    # the probe's, of the whole model trained (a frozen base skips its weight gradients: an upper bound).
    trained = run.get("trainable_parameters") or run["parameters"]
    # Both engines recompute: forward without a graph, then forward with it and backward.
    cpu_seconds = m * (compute["forward_s"] + compute["forward_backward_s"]) + \
        trained / machine["adam_elements_per_s"]
    read_rate, write_rate = machine["ssd_read_bytes_per_s"], machine["ssd_write_bytes_per_s"]
    io_seconds = run["ssd_read_bytes_per_step"] / read_rate + run["ssd_write_bytes_per_step"] / write_rate
    # The vertical schedule's minimum SSD volume (fp32; ranks hold shards, so the total does not change
    # with their number): every layer read once per sweep (twice; greedysnake keeps one layer across the
    # turn, so this is at most one layer's read above its volume), master weights and moments read
    # once and written once, new weights written once; gradients stay in host memory.
    # Optimizer states greedysnake keeps in host memory (optimizer_host_memory_mb) move no SSD bytes.
    p = run["parameters"] * 4
    states = 3 * (trained - run.get("host_state_parameters", 0)) * 4
    vertical_io = (2 * p + states) / read_rate + (states + trained * 4) / write_rate
    bound = max(cpu_seconds, io_seconds)
    vertical_bound = max(cpu_seconds, vertical_io)
    # Not the roofline: what overlap costs here. The same bound with compute measured while another
    # process streams through the SSD (compute and transfers overlap in both engines).
    streaming = streaming_compute(machine["compute"][run["config"]], run["micro_batches"])
    streaming_cpu_seconds = m * (streaming["forward_s"] + streaming["forward_backward_s"]) + \
        trained / machine["adam_elements_per_s"]
    streaming_bound = max(streaming_cpu_seconds, io_seconds)
    around = {}
    if rates_around_run:
        around_read = max(probe["ssd_read_bytes_per_s"] for probe in rates_around_run)
        around_write = max(probe["ssd_write_bytes_per_s"] for probe in rates_around_run)
        around_io = run["ssd_read_bytes_per_step"] / around_read + run["ssd_write_bytes_per_step"] / around_write
        around_bound = max(cpu_seconds, around_io)
        around = {"around_run_ssd_read_bytes_per_s": around_read, "around_run_ssd_write_bytes_per_s": around_write,
                  "around_run_io_seconds": around_io, "around_run_bound_seconds": around_bound,
                  "distance_to_around_run_bound": run["step_seconds_median"] / around_bound,
                  "around_run_limited_by": "SSD" if around_io > cpu_seconds else "CPU"}
    return {**around, "cpu_seconds": cpu_seconds, "io_seconds": io_seconds, "bound_seconds": bound,
            "streaming_cpu_seconds": streaming_cpu_seconds, "streaming_bound_seconds": streaming_bound,
            "distance_to_streaming_bound": run["step_seconds_median"] / streaming_bound,
            "bound_tokens_per_second": run["tokens_per_step"] / bound,
            "vertical_io_seconds": vertical_io, "vertical_bound_seconds": vertical_bound,
            "vertical_bound_tokens_per_second": run["tokens_per_step"] / vertical_bound,
            "distance_to_bound": run["step_seconds_median"] / bound,
            "distance_to_vertical_bound": run["step_seconds_median"] / vertical_bound,
            "limited_by": "SSD" if io_seconds > cpu_seconds else "CPU"}


def markdown(report: dict) -> str:
    lines = [f"A/B benchmark, {report['started']}, {report['machine']['cpus']} CPUs, "
             f"{'quick' if report['quick'] else 'default'} sweep, {report['warmup']} warm-up + "
             f"{report['steps']} measured steps (median), SSD {report['machine']['ssd_read_bytes_per_s'] / MIB:.0f} MiB/s "
             f"read / {report['machine']['ssd_write_bytes_per_s'] / MIB:.0f} MiB/s write, CPU Adam "
             f"{report['machine']['adam_elements_per_s'] / 1e6:.0f} M elements/s"
             + (f"; greedysnake options {report['greedysnake_options']}" if report.get("greedysnake_options") else ""),
             ""]
    for name, model_spec in report["configs"].items():
        compute = report["machine"]["compute"][name]
        lines.append(f"**{name}**: GPT {model_spec['layers']} blocks, hidden {model_spec['hidden']}, vocab "
                     f"{model_spec['vocab']}, micro-batch {model_spec['micro_batch_size']} x {model_spec['seq_len']} "
                     f"tokens, fp32; forward {1000 * compute['forward_s']:.0f} ms, forward+backward "
                     f"{1000 * compute['forward_backward_s']:.0f} ms per micro-batch as one whole-model pass"
                     + "".join(f"; vertical order at M={m}: {1000 * v['forward_s']:.0f} / "
                               f"{1000 * v['forward_backward_s']:.0f} ms" for m, v in compute.get("vertical", {}).items())
                     + "".join(f"; vertical order at M={m} while the SSD streams "
                               f"({compute['streaming_bytes_per_s'] / MIB:.0f} MiB/s): {1000 * v['forward_s']:.0f} / "
                               f"{1000 * v['forward_backward_s']:.0f} ms"
                               for m, v in compute.get("vertical_streaming", {}).items()))
    lines += ["", "| config | M | ranks | engine | step s | tokens/s | speed-up | SSD read MiB/step (params) | "
              "SSD written MiB/step | proc read / written MiB | peak RSS MiB (worker) | final loss | "
              "roofline s (limit) | distance |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        roof = run["roofline"]
        pair = [r for r in report["runs"] if r["config"] == run["config"] and r["micro_batches"] == run["micro_batches"]
                and r.get("world_size", 1) == run.get("world_size", 1)
                and r.get("busy_cores", 0) == run.get("busy_cores", 0) and r["engine"] == "zero_infinity"]
        speedup = run["tokens_per_second"] / pair[0]["tokens_per_second"] if pair else float("nan")
        worker = f" ({run['peak_rss_children_mib']:.0f})" if run["engine"] == "greedysnake" else ""
        lines.append(
            f"| {run['config']} | {run['micro_batches']} | {ranks_column(run)} | {LABELS[run['engine']]} | "
            f"{run['step_seconds_median']:.2f} | "
            f"{run['tokens_per_second']:.0f} | {speedup:.2f}x | {run['ssd_read_bytes_per_step'] / MIB:.0f} "
            f"({run['param_read_bytes_per_step'] / MIB:.0f}) | {run['ssd_write_bytes_per_step'] / MIB:.0f} | "
            f"{run['proc_read_bytes_per_step'] / MIB:.0f} / {run['proc_write_bytes_per_step'] / MIB:.0f} | "
            f"{run['peak_rss_mib']:.0f}{worker} | {run['final_loss']:.5f} | {roof['bound_seconds']:.2f} "
            f"({roof['limited_by']}) | {roof['distance_to_bound']:.2f}x |")
    lines += ["", "Step time against each bound (docs/ab_bench.md): the roofline from the machine probe; the same "
              "with the SSD rates probed right before and after the run (the faster of the two, MiB/s read / write); "
              "the vertical schedule's minimum SSD volume; compute measured while another process streams through "
              "the SSD (a bound, not a roofline).", "",
              "| config | M | ranks | engine | step s | roofline s (limit) | distance | SSD around the run | "
              "roofline at those rates s (limit) | distance | vertical roofline s | distance | "
              "bound with compute under streaming s | distance |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        roof = run["roofline"]
        if "around_run_bound_seconds" in roof:
            around = (f"{roof['around_run_ssd_read_bytes_per_s'] / MIB:.0f} / "
                      f"{roof['around_run_ssd_write_bytes_per_s'] / MIB:.0f} | {roof['around_run_bound_seconds']:.2f} "
                      f"({roof['around_run_limited_by']}) | {roof['distance_to_around_run_bound']:.2f}x")
        else:
            around = "- | - | -"
        lines.append(
            f"| {run['config']} | {run['micro_batches']} | {run.get('world_size', 1)} | {LABELS[run['engine']]} | "
            f"{run['step_seconds_median']:.2f} | {roof['bound_seconds']:.2f} ({roof['limited_by']}) | "
            f"{roof['distance_to_bound']:.2f}x | {around} | {roof['vertical_bound_seconds']:.2f} | "
            f"{roof['distance_to_vertical_bound']:.2f}x | {roof['streaming_bound_seconds']:.2f} | "
            f"{roof['distance_to_streaming_bound']:.2f}x |")
    lines += ["", "| config | M | ranks | final loss ZeRO-Infinity | final loss greedysnake | relative difference |",
              "|---|---|---|---|---|---|"]
    for item in report["loss_agreement"]:
        lines.append(f"| {item['config']} | {item['micro_batches']} | {item.get('world_size', 1)} | "
                     f"{item['zero_infinity']:.6f} | "
                     f"{item['greedysnake']:.6f} | {item['relative_difference']:.1e} |")
    lines += busy_table(report)
    lines += floor_table(report)
    gs_runs = [r for r in report["runs"] if r["engine"] == "greedysnake"]
    if gs_runs:
        ops = sorted({op for r in gs_runs for op in r["seconds_by_op_mean"]})
        lines += ["", "greedysnake seconds per step by op (engine.last_step_metrics.seconds_by_op, mean):", "",
                  "| config | M | ranks | " + " | ".join(ops) + " | optimizer (worker) | optimizer wait |",
                  "|---|---|---|" + "---|" * (len(ops) + 2)]
        for r in gs_runs:
            lines.append(f"| {r['config']} | {r['micro_batches']} | {r.get('world_size', 1)} | "
                         + " | ".join(f"{r['seconds_by_op_mean'].get(op, 0.0):.2f}" for op in ops)
                         + f" | {r['optimizer_seconds_mean']:.2f} | {r['optimizer_wait_seconds_mean']:.2f} |")
    return "\n".join(lines) + "\n"


def ranks_column(run: dict) -> str:
    busy = run.get("busy_cores", 0)
    return f"{run.get('world_size', 1)}" + (f", beside {busy} busy" if busy else "")


def busy_table(report: dict) -> list:
    """With --busy-cores: each engine's step alone and beside the busy processes, and the speed-up in both."""
    busy = report.get("busy_cores", 0)
    beside = [r for r in report["runs"] if r.get("busy_cores", 0)]
    if not busy or not beside:
        return []
    lines = ["", f"Beside {busy} process(es) that each keep a core busy (`--busy-cores {busy}`), against the same "
             "run alone just before it:", "",
             "| config | M | ranks | engine | step s alone | step s beside | slow-down | speed-up alone | "
             "speed-up beside |", "|---|---|---|---|---|---|---|---|---|"]

    def matching(run, engine, busy_cores):
        return next((r for r in report["runs"] if r["config"] == run["config"] and r["engine"] == engine
                     and r["micro_batches"] == run["micro_batches"] and r.get("busy_cores", 0) == busy_cores
                     and r.get("world_size", 1) == run.get("world_size", 1)), None)

    for run in beside:
        alone = matching(run, run["engine"], 0)
        if alone is None:
            continue
        speedups = []
        for busy_cores in (0, run["busy_cores"]):
            gs, zi = matching(run, "greedysnake", busy_cores), matching(run, "zero_infinity", busy_cores)
            speedups.append(f"{gs['tokens_per_second'] / zi['tokens_per_second']:.2f}x" if gs and zi else "-")
        lines.append(f"| {run['config']} | {run['micro_batches']} | {run.get('world_size', 1)} | "
                     f"{LABELS[run['engine']]} | {alone['step_seconds_median']:.2f} | {run['step_seconds_median']:.2f} | "
                     f"{run['step_seconds_median'] / alone['step_seconds_median']:.2f}x | {speedups[0]} | {speedups[1]} |")
    return lines


def floor_table(report: dict) -> list:
    """greedysnake's step against its floor, measured from its own steps (ab_bench_floor.py), and where the
    step's time went; medians over the measured steps (rounds)."""
    runs = [r for r in report["runs"] if "floors" in r]
    if not runs:
        return []
    lines = ["", "greedysnake's step against its own floor: each measured step's SSD operations replayed right after "
             "the run with no compute (I/O), the compute alone in the vertical order, CPU Adam alone over the "
             "trainable parameters; floor = the largest, and max(I/O, compute + Adam) where they share the cores "
             "(ab_bench_floor.py). Medians over the rounds. The compute alone is the device's work (timed between "
             "synchronizes); in where the step's time went, compute (clock) is the step's compute ops by the host's "
             "clock on the CPU, by the device's (timing events) off it.", "",
             "| config | M | rounds | step s | I/O replay s (MiB/s) | compute s | Adam s | floor s (is) | step / floor | "
             "shared-cores floor s | step / it | compute (clock) | SSD waits | worker waits | rest |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        f = run["floors"]
        kinds = [r["floor_is"] for r in f["rounds"]]
        b = f["breakdown_mean"]  # reports from before compute_clock existed timed compute by the host
        lines.append(
            f"| {run['config']} | {run['micro_batches']} | {len(f['rounds'])} | {f['step_s_median']:.3f} | "
            f"{f['io_replay_s_median']:.3f} ({f['replay_bytes_per_s_median'] / MIB:.0f}) | {f['compute_s_median']:.3f} | "
            f"{f['adam_s_median']:.3f} | {f['floor_s_median']:.3f} ({max(set(kinds), key=kinds.count)}) | "
            f"{f['step_over_floor_median']:.2f}x | {f['shared_cores_floor_s_median']:.3f} | "
            f"{f['step_over_shared_cores_floor_median']:.2f}x | {b['compute']:.3f} ({b.get('compute_clock', 'host')}) | "
            f"{b['ssd_wait']:.3f} | {b['worker_wait']:.3f} | {b['rest']:.3f} |")
    return lines


def plot_time(report: dict, path: str) -> None:
    """Where greedysnake's step time goes: a stacked bar per run (compute, SSD waits, waits on the optimizer
    worker, the rest), with its floors marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if "floors" in r]
    figure, axis = plt.subplots(figsize=(max(5.0, 1.4 * len(runs) + 2), 4.5))
    parts = (("compute", "tab:blue"), ("ssd_wait", "tab:orange"), ("worker_wait", "tab:green"), ("rest", "tab:gray"))
    for index, run in enumerate(runs):
        bottom = 0.0
        breakdown = run["floors"]["breakdown_mean"]
        for part, colour in parts:
            axis.bar(index, breakdown[part], bottom=bottom, color=colour, width=0.6,
                     label=part.replace("_", " ") if index == 0 else None)
            bottom += breakdown[part]
        floors = run["floors"]
        for key, marker, name in (("io_replay_s_median", "v", "I/O replay"), ("compute_s_median", "^", "compute alone"),
                                  ("adam_s_median", "s", "Adam alone")):
            axis.plot([index + 0.38], [floors[key]], marker, color="black", fillstyle="none",
                      label=name if index == 0 else None)
    axis.set_xticks(range(len(runs)))
    axis.set_xticklabels([f"{r['config']}\nM={r['micro_batches']}" for r in runs])
    axis.set_ylabel("seconds per step (mean over the measured steps)")
    axis.set_title("greedysnake: where a step's time goes, and its floors", fontsize=10)
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["configs"])
    figure, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for axis, name in zip(axes[0], names):
        for engine, colour in (("zero_infinity", "tab:red"), ("greedysnake", "tab:blue")):
            runs = sorted((r for r in report["runs"] if r["config"] == name and r["engine"] == engine
                           and r.get("world_size", 1) == 1 and not r.get("busy_cores", 0)),
                          key=lambda r: r["global_batch"])
            for run in report["runs"]:  # runs on several ranks: one marker each
                if run["config"] == name and run["engine"] == engine and run.get("world_size", 1) > 1:
                    axis.plot([run["global_batch"]], [run["tokens_per_second"]], "s", color=colour, fillstyle="none",
                              label=f"{LABELS[engine]}, {run['world_size']} ranks")
            if not runs:
                continue
            batch = [r["global_batch"] for r in runs]
            axis.plot(batch, [r["tokens_per_second"] for r in runs], "o-", color=colour, label=f"{LABELS[engine]} measured")
            axis.plot(batch, [r["roofline"]["bound_tokens_per_second"] for r in runs], "--", color=colour,
                      label=f"roofline, {LABELS[engine]}'s SSD volume")
            if engine == "greedysnake":
                axis.plot(batch, [r["roofline"]["vertical_bound_tokens_per_second"] for r in runs], ":",
                          color="black", label="roofline, vertical schedule's minimum volume")
        model_spec = report["configs"][name]
        axis.set_title(f"{name}: {model_spec['layers']} blocks, hidden {model_spec['hidden']}, "
                       f"{model_spec['micro_batch_size']} x {model_spec['seq_len']} tokens / micro-batch", fontsize=9)
        axis.set_xlabel("global batch (sequences per step = M x micro-batch size x ranks)")
        axis.set_ylabel("tokens/s")
        axis.set_xscale("log", base=2)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


