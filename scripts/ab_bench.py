"""A/B benchmark: DeepSpeed's ZeRO-Infinity against greedysnake on the same model, data and ds_config.

    python scripts/ab_bench.py --quick                 # a few minutes on 2 cores (small sizes, M in 1 4)
    python scripts/ab_bench.py                         # the default sweep (see docs/ab_bench.md for its time)
    python scripts/ab_bench.py --configs ssd_bound --micro-batches 1 2 4 8

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
import glob
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                   ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29523")):
    os.environ.setdefault(key, value)
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as scripts/env.sh does
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))

MIB = 2**20
ENGINES = ("zero_infinity", "greedysnake")
LABELS = {"zero_infinity": "ZeRO-Infinity", "greedysnake": "greedysnake"}

# Two regimes. ssd_bound: few tokens per micro-batch against many parameter bytes, so reading the
# parameters (again per micro-batch, for ZeRO-Infinity) dominates. compute_bound: a smaller model with
# many tokens per micro-batch.
CONFIGS = {
    "ssd_bound": dict(hidden=1024, layers=2, heads=8, vocab=2048, seq_len=32, micro_batch_size=1),
    "compute_bound": dict(hidden=512, layers=2, heads=8, vocab=2048, seq_len=128, micro_batch_size=4),
}
QUICK_CONFIGS = {
    "ssd_bound": dict(hidden=512, layers=2, heads=8, vocab=1024, seq_len=32, micro_batch_size=1),
    "compute_bound": dict(hidden=256, layers=2, heads=4, vocab=1024, seq_len=128, micro_batch_size=4),
}
# The same aio block for both engines (and for the roofline's SSD rates).
AIO = {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}


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
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- shared helpers


def ds_config(nvme_path: str, micro_batch_size: int, num_micro_batches: int, enabled: bool,
              largest_param_numel: int) -> dict:
    """One ds_config for both engines; greedysnake ignores the ZeRO-Infinity-only knobs."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": num_micro_batches,
        # Explicit: DeepSpeed 0.19.8 clips at 1.0 when the key is absent.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            # Each needed for ZeRO-Infinity to run (or to be correct) on DeepSpeed 0.19.8: docs/zero_infinity.md.
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": 100000,  # DeepSpeed's default, stated
            "sub_group_size": 1,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0, "pin_memory": False,
                              "buffer_count": 5, "buffer_size": largest_param_numel},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False},
        },
        "aio": dict(AIO),
        "greedysnake": {"enabled": enabled},
    }


def gpt_config(model: dict):
    from ds_greedysnake.models.gpt import GPTConfig
    return GPTConfig(vocab_size=model["vocab"], seq_len=model["seq_len"], hidden=model["hidden"],
                     num_heads=model["heads"], num_layers=model["layers"])


def largest_param_numel(model: dict) -> int:
    hidden, vocab = model["hidden"], model["vocab"]
    return max(4 * hidden * hidden + 4 * hidden, vocab * hidden, 3 * hidden * hidden + 3 * hidden)


def parameter_count(model: dict) -> int:
    h, v, s, n = model["hidden"], model["vocab"], model["seq_len"], model["layers"]
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    return v * h + s * h + n * block + 2 * h + v * h


def process_io() -> dict:
    try:
        with open("/proc/self/io") as handle:
            fields = dict(line.split(": ") for line in handle.read().splitlines())
        return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"])}
    except OSError:
        return {"read_bytes": 0, "write_bytes": 0}


def peak_rss_mib(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux reports KiB


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def remove_shm_buffers(port: str) -> None:
    """DeepSpeed's CPU comm op leaves /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.remove(path)
        except OSError:
            pass


# ----------------------------------------------------------------------------- child: one engine run


def run_engine(spec: dict) -> dict:
    print(f"{time.strftime('%H:%M:%S')} importing", flush=True)
    import torch
    import deepspeed
    from torch import nn

    import ds_greedysnake
    from ds_greedysnake.deepspeed_compat import count_zero_param_swap_reads
    from ds_greedysnake.models.gpt import build_gpt, lm_loss, micro_batches, synthetic_corpus

    print(f"{time.strftime('%H:%M:%S')} imported", flush=True)
    engine_name, model_spec, m = spec["engine"], spec["model"], spec["micro_batches"]
    mbs = model_spec["micro_batch_size"]
    os.makedirs(spec["nvme_path"], exist_ok=True)
    ds = ds_config(spec["nvme_path"], mbs, m, engine_name == "greedysnake", largest_param_numel(model_spec))
    gpt = gpt_config(model_spec)
    torch.manual_seed(spec["seed"])
    if engine_name == "zero_infinity":
        class CheckpointedGPT(nn.Sequential):
            """[embedding, blocks..., head] with DeepSpeed's activation checkpointing around each block,
            so the baseline recomputes in backward as greedysnake does. torch.utils.checkpoint gives
            wrong gradients with NVMe parameters on DeepSpeed 0.19.8 (docs/zero_infinity.md)."""

            def forward(self, token_ids):
                hidden = self[0](token_ids)
                for block in list(self)[1:-1]:
                    hidden = deepspeed.checkpointing.checkpoint(block, hidden)
                return self[-1](hidden)

        from deepspeed.accelerator import get_accelerator
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        deepspeed.checkpointing.configure(None, deepspeed_config=ds)
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = CheckpointedGPT(*build_gpt(gpt))
    else:
        model = build_gpt(gpt)
    parameters = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    engine, _, _, _ = ds_greedysnake.initialize(model=model, model_parameters=model.parameters(), config=ds,
                                                loss_fn=lm_loss)
    batches = micro_batches(synthetic_corpus(100_000, model_spec["vocab"], spec["seed"]), mbs,
                            model_spec["seq_len"], spec["seed"])
    steps = []
    for index in range(spec["warmup"] + spec["steps"]):
        io_before = process_io()
        started = time.perf_counter()
        if engine_name == "zero_infinity":
            with count_zero_param_swap_reads() as counter:
                loss = float(engine.train_batch(batches))
        else:
            loss = float(engine.train_batch(batches))
        seconds = time.perf_counter() - started
        io_after = process_io()
        record = {"step": index + 1, "warmup": index < spec["warmup"], "seconds": seconds, "loss": loss,
                  "proc_read_bytes": io_after["read_bytes"] - io_before["read_bytes"],
                  "proc_write_bytes": io_after["write_bytes"] - io_before["write_bytes"]}
        if engine_name == "zero_infinity":
            record.update(param_read_bytes=counter.bytes, param_reads=counter.reads,
                          # No aio-layer counters for the optimizer swapper: the process's I/O is the total.
                          ssd_read_bytes=record["proc_read_bytes"], ssd_write_bytes=record["proc_write_bytes"])
        else:
            metrics = engine.last_step_metrics
            record.update(param_read_bytes=metrics.ssd_bytes_read.get("param", 0),
                          param_reads=metrics.ssd_reads.get("param", 0),
                          ssd_read_bytes=sum(metrics.ssd_bytes_read.values()),
                          ssd_write_bytes=sum(metrics.ssd_bytes_written.values()),
                          ssd_bytes_read_by_kind=dict(metrics.ssd_bytes_read),
                          ssd_bytes_written_by_kind=dict(metrics.ssd_bytes_written),
                          worker_read_bytes=metrics.ssd_bytes_read.get("optimizer_worker", 0),
                          worker_write_bytes=metrics.ssd_bytes_written.get("optimizer_worker", 0),
                          seconds_by_op=dict(metrics.seconds_by_op),
                          compute_seconds=metrics.compute_seconds,
                          optimizer_seconds=metrics.optimizer_seconds,
                          optimizer_wait_seconds=metrics.optimizer_wait_seconds)
        steps.append(record)
        print(json.dumps({k: v for k, v in record.items() if not isinstance(v, dict)}), flush=True)
    if engine_name == "greedysnake":
        engine.close()
    measured = [s for s in steps if not s["warmup"]]
    median = lambda key: statistics.median(s[key] for s in measured)
    tokens = m * mbs * model_spec["seq_len"]
    result = {
        "engine": engine_name, "config": spec["config"], "micro_batches": m, "micro_batch_size": mbs,
        "global_batch": m * mbs, "tokens_per_step": tokens, "parameters": parameters,
        "step_seconds_median": median("seconds"), "tokens_per_second": tokens / median("seconds"),
        "ssd_read_bytes_per_step": median("ssd_read_bytes"), "ssd_write_bytes_per_step": median("ssd_write_bytes"),
        "param_read_bytes_per_step": median("param_read_bytes"),
        "proc_read_bytes_per_step": median("proc_read_bytes"),
        "proc_write_bytes_per_step": median("proc_write_bytes"),
        "peak_rss_mib": peak_rss_mib(),
        # The optimizer worker (greedysnake) is a child process: its peak is reported apart, once joined.
        "peak_rss_children_mib": peak_rss_mib(resource.RUSAGE_CHILDREN),
        "final_loss": steps[-1]["loss"], "losses": [s["loss"] for s in steps],
        "steps": steps, "ds_config": ds, "torch_threads": torch.get_num_threads(),
    }
    if engine_name == "greedysnake":
        result["worker_read_bytes_per_step"] = median("worker_read_bytes")
        result["worker_write_bytes_per_step"] = median("worker_write_bytes")
        ops = {}
        for s in measured:
            for op, secs in s["seconds_by_op"].items():
                ops[op] = ops.get(op, 0.0) + secs / len(measured)
        result["seconds_by_op_mean"] = ops
        result["optimizer_seconds_mean"] = statistics.mean(s["optimizer_seconds"] for s in measured)
        result["optimizer_wait_seconds_mean"] = statistics.mean(s["optimizer_wait_seconds"] for s in measured)
        # Cross-check: the aio counters against this process's I/O plus the worker's aio counters.
        result["io_crosscheck_read"] = ((result["proc_read_bytes_per_step"] + result["worker_read_bytes_per_step"])
                                        / max(1, result["ssd_read_bytes_per_step"]))
        result["io_crosscheck_write"] = ((result["proc_write_bytes_per_step"] + result["worker_write_bytes_per_step"])
                                         / max(1, result["ssd_write_bytes_per_step"]))
    else:
        # Parameter reads counted at the swapper against everything the process read.
        result["io_crosscheck_read"] = result["param_read_bytes_per_step"] / max(1, result["proc_read_bytes_per_step"])
        result["io_crosscheck_write"] = None
    return result


# ----------------------------------------------------------------------------- child: machine rates


def measure_machine(spec: dict) -> dict:
    print(f"{time.strftime('%H:%M:%S')} importing", flush=True)
    import torch
    from ds_greedysnake import deepspeed_compat
    from ds_greedysnake.deepspeed_compat import AdamHyperparameters, CpuAdamKernel
    from ds_greedysnake.models.gpt import build_gpt, lm_loss
    from ds_greedysnake.ssd import IoCounters, SsdStore

    result = {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    # SSD: one large region through DeepSpeed's aio handle, same aio block as the runs.
    folder = spec["nvme_path"]
    store = SsdStore(folder, {"aio": dict(AIO)}, IoCounters(), "roofline")
    region_bytes = spec["ssd_region_mib"] * MIB
    region = store.create_region("probe", region_bytes, "probe")
    buffer = store.new_buffer(region)
    buffer.fill_(7)
    writes, reads = [], []
    for _ in range(spec["ssd_repeats"]):
        started = time.perf_counter()
        store.write(region, buffer)
        writes.append(time.perf_counter() - started)
        started = time.perf_counter()
        store.read(region, buffer)
        reads.append(time.perf_counter() - started)
    result["ssd_region_bytes"] = region.padded_bytes
    result["ssd_read_bytes_per_s_one_region"] = region.padded_bytes / statistics.median(reads)
    result["ssd_write_bytes_per_s"] = region.padded_bytes / statistics.median(writes)
    # Several reads in flight on one handle (ZeRO-Infinity's swapper issues several at once); the
    # roofline takes the faster of the two read rates.
    parts = 4
    regions = [store.create_region(f"part{i}", region_bytes // parts, "probe") for i in range(parts)]
    buffers = [store.new_buffer(r) for r in regions]
    for r, b in zip(regions, buffers):
        store.write(r, b)
    handle = deepspeed_compat.new_aio_handle({"aio": dict(AIO)})
    parallel = []
    for _ in range(spec["ssd_repeats"]):
        started = time.perf_counter()
        for r, b in zip(regions, buffers):
            handle.pread(b[:r.padded_bytes], r.path, False, True, 0)
        completed = handle.wait()
        parallel.append(time.perf_counter() - started)
        assert completed == parts, completed
    result["ssd_read_bytes_per_s_parallel"] = sum(r.padded_bytes for r in regions) / statistics.median(parallel)
    result["ssd_read_bytes_per_s"] = max(result["ssd_read_bytes_per_s_one_region"],
                                         result["ssd_read_bytes_per_s_parallel"])
    # CPU Adam: DeepSpeed's kernel on flat fp32 tensors.
    numel = spec["adam_numel"]
    hyper = AdamHyperparameters(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    kernel = CpuAdamKernel(hyper, adamw_mode=True)
    tensors = [torch.randn(numel) for _ in range(4)]
    times = []
    for step in range(1, 8):
        started = time.perf_counter()
        kernel.update(step, hyper, *tensors)
        times.append(time.perf_counter() - started)
    result["adam_elements_per_s"] = numel / statistics.median(times[1:])
    # Compute: plain PyTorch forward (no graph) and forward+backward per micro-batch, per configuration.
    result["compute"] = {}
    for name, model_spec in spec["configs"].items():
        torch.manual_seed(0)
        model = build_gpt(gpt_config(model_spec))
        tokens = torch.randint(0, model_spec["vocab"], (model_spec["micro_batch_size"], model_spec["seq_len"]))
        forward, forward_backward = [], []
        for _ in range(spec["compute_repeats"] + 1):
            started = time.perf_counter()
            with torch.no_grad():
                model(tokens)
            forward.append(time.perf_counter() - started)
            started = time.perf_counter()
            lm_loss(model(tokens), tokens).backward()
            forward_backward.append(time.perf_counter() - started)
            model.zero_grad(set_to_none=False)  # reuse the gradient buffers, as the engines do
        # The fastest repeat: the roofline is the best the machine does (this machine is shared and noisy).
        result["compute"][name] = {"forward_s": min(forward[1:]), "forward_backward_s": min(forward_backward[1:])}
    return result


# ----------------------------------------------------------------------------- parent


def run_child(kind: str, spec: dict, args, log_name: str) -> dict:
    os.makedirs(os.path.join(args.out_dir, "runs"), exist_ok=True)
    spec_path = os.path.join(args.out_dir, "runs", log_name + ".spec.json")
    result_path = os.path.join(args.out_dir, "runs", log_name + ".json")
    log_path = os.path.join(args.out_dir, "runs", log_name + ".log")
    spec = dict(spec, kind=kind, result_path=result_path)
    with open(spec_path, "w") as handle:
        json.dump(spec, handle)
    started = time.time()
    attempts = []
    for attempt in range(2):  # one retry: a child has died of a native abort on this machine
        port = free_port()
        env = dict(os.environ, MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1",
                   MASTER_ADDR="127.0.0.1")
        try:
            with open(log_path, "w") as log:
                completed = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec_path],
                                           stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                           timeout=args.child_timeout)
        finally:
            remove_shm_buffers(port)
            if spec.get("nvme_path"):
                shutil.rmtree(spec["nvme_path"], ignore_errors=True)
        attempts.append(completed.returncode)
        if completed.returncode == 0 and os.path.exists(result_path):
            break
        with open(log_path) as log:
            tail = log.read()[-4000:]
        os.replace(log_path, f"{log_path}.failed{attempt}")
        print(f"  {log_name} failed (exit {completed.returncode}), log {log_path}.failed{attempt}:\n{tail[-1500:]}",
              flush=True)
    else:
        raise RuntimeError(f"{log_name} failed twice (exits {attempts}); logs {log_path}.failed*")
    with open(result_path) as handle:
        result = json.load(handle)
    result["child_wall_seconds"] = time.time() - started
    result["child_exit_codes"] = attempts
    print(f"  {log_name}: {result['child_wall_seconds']:.0f}s", flush=True)
    return result


def roofline(run: dict, machine: dict, model_spec: dict) -> dict:
    """The best step time the machine allows for this run's measured SSD volume and compute.

    CPU work (forward, recompute and backward of every micro-batch, and Adam over every parameter)
    shares the same cores, so it adds up; SSD transfers run on the aio threads and can overlap the CPU
    work, but reads and writes share the SSD. Bound = max(CPU time, SSD time)."""
    compute = machine["compute"][run["config"]]
    m = run["micro_batches"]
    # Both engines recompute: forward without a graph, then forward with it and backward.
    cpu_seconds = m * (compute["forward_s"] + compute["forward_backward_s"]) + \
        run["parameters"] / machine["adam_elements_per_s"]
    read_rate, write_rate = machine["ssd_read_bytes_per_s"], machine["ssd_write_bytes_per_s"]
    io_seconds = run["ssd_read_bytes_per_step"] / read_rate + run["ssd_write_bytes_per_step"] / write_rate
    # The vertical schedule's minimum volume (fp32): every layer read once per sweep (twice), master
    # weights, moments and the accumulated gradient read once and written once, new weights written once.
    p = run["parameters"] * 4
    vertical_io = (2 * p + 4 * p) / read_rate + (4 * p + p) / write_rate
    bound = max(cpu_seconds, io_seconds)
    vertical_bound = max(cpu_seconds, vertical_io)
    return {"cpu_seconds": cpu_seconds, "io_seconds": io_seconds, "bound_seconds": bound,
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
             f"{report['machine']['adam_elements_per_s'] / 1e6:.0f} M elements/s", ""]
    for name, model_spec in report["configs"].items():
        compute = report["machine"]["compute"][name]
        lines.append(f"**{name}**: GPT {model_spec['layers']} blocks, hidden {model_spec['hidden']}, vocab "
                     f"{model_spec['vocab']}, micro-batch {model_spec['micro_batch_size']} x {model_spec['seq_len']} "
                     f"tokens, fp32; forward {1000 * compute['forward_s']:.0f} ms, forward+backward "
                     f"{1000 * compute['forward_backward_s']:.0f} ms per micro-batch")
    lines += ["", "| config | M | engine | step s | tokens/s | speed-up | SSD read MiB/step (params) | "
              "SSD written MiB/step | proc read / written MiB | peak RSS MiB (worker) | final loss | "
              "roofline s (limit) | distance | vertical roofline s | distance |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        roof = run["roofline"]
        pair = [r for r in report["runs"] if r["config"] == run["config"] and r["micro_batches"] == run["micro_batches"]
                and r["engine"] == "zero_infinity"]
        speedup = run["tokens_per_second"] / pair[0]["tokens_per_second"] if pair else float("nan")
        worker = f" ({run['peak_rss_children_mib']:.0f})" if run["engine"] == "greedysnake" else ""
        lines.append(
            f"| {run['config']} | {run['micro_batches']} | {LABELS[run['engine']]} | {run['step_seconds_median']:.2f} | "
            f"{run['tokens_per_second']:.0f} | {speedup:.2f}x | {run['ssd_read_bytes_per_step'] / MIB:.0f} "
            f"({run['param_read_bytes_per_step'] / MIB:.0f}) | {run['ssd_write_bytes_per_step'] / MIB:.0f} | "
            f"{run['proc_read_bytes_per_step'] / MIB:.0f} / {run['proc_write_bytes_per_step'] / MIB:.0f} | "
            f"{run['peak_rss_mib']:.0f}{worker} | {run['final_loss']:.5f} | {roof['bound_seconds']:.2f} "
            f"({roof['limited_by']}) | {roof['distance_to_bound']:.2f}x | {roof['vertical_bound_seconds']:.2f} | "
            f"{roof['distance_to_vertical_bound']:.2f}x |")
    lines += ["", "| config | M | final loss ZeRO-Infinity | final loss greedysnake | relative difference |",
              "|---|---|---|---|---|"]
    for item in report["loss_agreement"]:
        lines.append(f"| {item['config']} | {item['micro_batches']} | {item['zero_infinity']:.6f} | "
                     f"{item['greedysnake']:.6f} | {item['relative_difference']:.1e} |")
    gs_runs = [r for r in report["runs"] if r["engine"] == "greedysnake"]
    if gs_runs:
        ops = sorted({op for r in gs_runs for op in r["seconds_by_op_mean"]})
        lines += ["", "greedysnake seconds per step by op (engine.last_step_metrics.seconds_by_op, mean):", "",
                  "| config | M | " + " | ".join(ops) + " | optimizer (worker) | optimizer wait |",
                  "|---|---|" + "---|" * (len(ops) + 2)]
        for r in gs_runs:
            lines.append(f"| {r['config']} | {r['micro_batches']} | "
                         + " | ".join(f"{r['seconds_by_op_mean'].get(op, 0.0):.2f}" for op in ops)
                         + f" | {r['optimizer_seconds_mean']:.2f} | {r['optimizer_wait_seconds_mean']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["configs"])
    figure, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for axis, name in zip(axes[0], names):
        for engine, colour in (("zero_infinity", "tab:red"), ("greedysnake", "tab:blue")):
            runs = sorted((r for r in report["runs"] if r["config"] == name and r["engine"] == engine),
                          key=lambda r: r["global_batch"])
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
        axis.set_xlabel("global batch (sequences per step = M x micro-batch size)")
        axis.set_ylabel("tokens/s")
        axis.set_xscale("log", base=2)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        with open(args.child) as handle:
            spec = json.load(handle)
        if os.path.exists(spec["result_path"]):
            os.remove(spec["result_path"])
        result = run_engine(spec) if spec["kind"] == "engine" else measure_machine(spec)
        with open(spec["result_path"], "w") as handle:
            json.dump(result, handle, indent=1)
        # DeepSpeed's native threads have aborted this process at exit ("terminate called without an
        # active exception") after a complete run; the result is written, so skip the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    began = time.time()
    base = QUICK_CONFIGS if args.quick else CONFIGS
    configs = {name: dict(base[name]) for name in (args.configs or list(base))}
    for spec in configs.values():
        for key, value in (("micro_batch_size", args.micro_batch_size), ("hidden", args.hidden), ("layers", args.layers),
                           ("seq_len", args.seq_len)):
            if value is not None:
                spec[key] = value
    sweep = args.micro_batches or ([1, 4] if args.quick else [1, 2, 4, 8])
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (2 if args.quick else 4)
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(args.nvme_path, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="run_", dir=args.nvme_path)
    print(f"A/B benchmark: configs {list(configs)}, M in {sweep}, {warmup} warm-up + {steps} measured steps; "
          f"SSD folder {scratch}", flush=True)
    try:
        machine = run_child("machine", {"nvme_path": os.path.join(scratch, "roofline"), "configs": configs,
                                        "ssd_region_mib": 64 if args.quick else 256,
                                        "ssd_repeats": 3 if args.quick else 5,
                                        "adam_numel": (1 << 23) if args.quick else (1 << 24),
                                        "compute_repeats": 4 if args.quick else 6}, args, "machine")
        runs = []
        for name, model_spec in configs.items():
            for m in sweep:
                for engine in args.engines:
                    spec = {"engine": engine, "config": name, "model": model_spec, "micro_batches": m,
                            "warmup": warmup, "steps": steps, "seed": 0,
                            "nvme_path": os.path.join(scratch, f"{engine}_{name}_m{m}")}
                    run = run_child("engine", spec, args, f"{name}_m{m}_{engine}")
                    run["roofline"] = roofline(run, machine, model_spec)
                    runs.append(run)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    agreement = []
    for name in configs:
        for m in sweep:
            pair = {r["engine"]: r["final_loss"] for r in runs if r["config"] == name and r["micro_batches"] == m}
            if len(pair) == 2:
                agreement.append({"config": name, "micro_batches": m, **pair, "relative_difference":
                                  abs(pair["greedysnake"] - pair["zero_infinity"]) / abs(pair["zero_infinity"])})
    report = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(began)), "quick": args.quick,
        "wall_seconds": None, "warmup": warmup, "steps": steps, "sweep": sweep, "configs": configs,
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
    print(f"total {report['wall_seconds']:.0f}s; JSON {os.path.join(args.out_dir, 'ab_bench.json')}")


if __name__ == "__main__":
    main()
