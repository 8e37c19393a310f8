"""One child of the A/B benchmark, in its own process: one engine run on one rank, or the machine probe.

    python scripts/bench/ab_bench/ab_bench_child.py SPEC.json      # written by scripts/bench/ab_bench/ab_bench.py

Each engine runs in a fresh process because DeepSpeed's zero.Init replaces torch.nn.functional.linear
for the whole process; a run with several ranks is one process per rank, started by the parent with
the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""
import json
import os
import resource
import statistics
import sys
import time
import traceback

from ab_bench_setup import (AIO, MIB, add_lora, ds_config, gpt_config, largest_param_numel, peak_rss_mib,  # noqa: E402
                            process_io)


def _copy_into_partitioned(model, same) -> None:
    """Every parameter of ``model`` (partitioned by zero.Init) takes the value of ``same``'s."""
    import deepspeed

    for param, value in zip(model.parameters(), same.parameters(), strict=True):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(value.data)


def _mean_of(steps: list, key: str) -> dict:
    """Each name's mean over ``steps`` of the per-step dicts ``step[key]``."""
    means = {}
    for step in steps:
        for name, seconds in step[key].items():
            means[name] = means.get(name, 0.0) + seconds / len(steps)
    return means


def run_engine(spec: dict) -> dict:
    print(f"{time.strftime('%H:%M:%S')} importing", flush=True)
    import torch
    import deepspeed

    import ds_greedysnake
    from ds_greedysnake.deepspeed_compat import (count_zero_param_swap_reads, profile_zero_step, time_engine_phases,
                                                 zero_checkpointed_gpt)
    from ds_greedysnake.models.gpt import build_gpt, lm_loss, micro_batches, synthetic_corpus

    print(f"{time.strftime('%H:%M:%S')} imported", flush=True)
    engine_name, model_spec, m = spec["engine"], spec["model"], spec["micro_batches"]
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    mbs = model_spec["micro_batch_size"]
    os.makedirs(spec["nvme_path"], exist_ok=True)
    ds = ds_config(spec["nvme_path"], mbs, m, engine_name == "greedysnake", largest_param_numel(model_spec))
    if engine_name == "greedysnake":
        ds["greedysnake"].update(spec.get("greedysnake_options", {}))
    gpt = gpt_config(model_spec)
    torch.manual_seed(spec["seed"])
    lora = bool(model_spec.get("lora_rank"))
    if engine_name == "zero_infinity":
        from deepspeed.accelerator import get_accelerator
        if lora:
            # PEFT imported first: zero.Init patches torch.Tensor.__new__, and torch._dynamo (which PEFT imports)
            # refuses to load under that patch.
            import peft  # noqa: F401
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        if not lora:
            # With LoRA no activation checkpointing: ZeRO-Infinity 0.19.8 fails with it over a frozen base ("Not
            # enough buffers 0 for swapping 1"), so that baseline keeps every activation instead of recomputing.
            deepspeed.checkpointing.configure(None, deepspeed_config=ds)
        same = add_lora(build_gpt(gpt), model_spec)  # what greedysnake trains, from the same seed, on the host
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = add_lora(build_gpt(gpt), model_spec) if lora else zero_checkpointed_gpt(build_gpt(gpt))
        # Both engines train one model: copy the host-built values in. Under zero.Init PEFT's initialisation of
        # an adapter (lora_B zeroed) reaches only an empty partition, and on a GPU every parameter is drawn from
        # the device's generator (the H200's first A/B, 2026-12-04: step-1 losses 7.750 and 7.838).
        _copy_into_partitioned(model, same)
        del same
    else:
        model = add_lora(build_gpt(gpt), model_spec)
    parameters = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if p.requires_grad)
    engine, _, _, _ = ds_greedysnake.initialize(model=model, model_parameters=model.parameters(), config=ds,
                                                loss_fn=lm_loss)
    # Each rank reads its own micro-batches, the same ones under both engines.
    data_seed = spec["seed"] + rank
    batches = micro_batches(synthetic_corpus(100_000, model_spec["vocab"], data_seed), mbs, model_spec["seq_len"],
                            data_seed)
    steps = []
    # greedysnake on one rank: each measured step is recorded, for its floor (ab_bench_floor.py).
    floors_wanted = engine_name == "greedysnake" and world_size == 1 and spec.get("floors", True)
    windows = []
    for index in range(spec["warmup"] + spec["steps"]):
        if floors_wanted and index == spec["warmup"]:
            engine.start_io_trace()
        io_before = process_io()
        window_start = time.monotonic()
        started = time.perf_counter()
        if engine_name == "zero_infinity":
            phase_seconds = {}
            with count_zero_param_swap_reads() as counter, profile_zero_step() as profile, \
                    time_engine_phases(engine, phase_seconds, m):
                loss = float(engine.train_batch(batches))
        else:
            loss = float(engine.train_batch(batches))
        seconds = time.perf_counter() - started
        if floors_wanted and index >= spec["warmup"]:
            windows.append((window_start, time.monotonic()))
        io_after = process_io()
        record = {"step": index + 1, "warmup": index < spec["warmup"], "seconds": seconds, "loss": loss,
                  "proc_read_bytes": io_after["read_bytes"] - io_before["read_bytes"],
                  "proc_write_bytes": io_after["write_bytes"] - io_before["write_bytes"]}
        if engine_name == "zero_infinity":
            record.update(param_read_bytes=counter.bytes, param_reads=counter.reads, seconds_by_phase=phase_seconds,
                          seconds_by_op=dict(profile.seconds), calls_by_op=dict(profile.calls),
                          # No aio-layer counters for the optimizer swapper: the process's I/O is the total.
                          ssd_read_bytes=record["proc_read_bytes"], ssd_write_bytes=record["proc_write_bytes"])
        else:
            metrics = engine.last_step_metrics
            # Parameter reads: the trainable slots and the frozen regions read with them (a LoRA run's base).
            record.update(param_read_bytes=metrics.ssd_bytes_read.get("param", 0) + metrics.ssd_bytes_read.get("frozen", 0),
                          param_reads=metrics.ssd_reads.get("param", 0) + metrics.ssd_reads.get("frozen", 0),
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
    floors = None
    if engine_name == "greedysnake":
        trace = engine.stop_io_trace() if floors_wanted else None
        engine.close()
        if floors_wanted:
            floors = measure_floors(engine, trace, windows, spec, gpt, trainable, batches)
    measured = [s for s in steps if not s["warmup"]]
    median = lambda key: statistics.median(s[key] for s in measured)
    tokens = m * mbs * model_spec["seq_len"] * world_size
    result = {
        "engine": engine_name, "config": spec["config"], "micro_batches": m, "micro_batch_size": mbs,
        "world_size": world_size, "rank": rank, "global_batch": m * mbs * world_size, "tokens_per_step": tokens, "parameters": parameters,
        "trainable_parameters": trainable, "lora_rank": model_spec.get("lora_rank"),
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
    if floors is not None:
        result["floors"] = floors
    if engine_name == "zero_infinity":  # the profile the planner's ZeRO-Infinity terms are checked against
        result["seconds_by_op_mean"] = _mean_of(measured, "seconds_by_op")
        result["seconds_by_phase_mean"] = _mean_of(measured, "seconds_by_phase")
        result["calls_by_op"] = measured[-1]["calls_by_op"]
    if engine_name == "greedysnake":
        # Parameters whose optimizer states stay in host memory (optimizer_host_memory_mb): no SSD bytes.
        result["host_state_parameters"] = sum(layer.numel for layer in engine.layers
                                              if engine.optimizer.states_in_host_memory(layer))
        result["worker_read_bytes_per_step"] = median("worker_read_bytes")
        result["worker_write_bytes_per_step"] = median("worker_write_bytes")
        result["seconds_by_op_mean"] = _mean_of(measured, "seconds_by_op")
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


def measure_floors(engine, trace, windows, spec: dict, gpt, trainable: int, batches) -> dict:
    """Each measured step's floors (ab_bench_floor.py), on the closed run's files; with ``trace_path``, the
    Chrome trace of the median step goes there."""
    import torch
    from ab_bench_floor import step_floors
    from ab_bench_setup import add_lora
    from ds_greedysnake.storage.io_trace import write_chrome_trace
    from ds_greedysnake.models.gpt import build_gpt

    from deepspeed.accelerator import get_accelerator

    m = spec["micro_batches"]
    torch.manual_seed(spec["seed"])
    # On the engine's device: with a GPU the compute floor is the GPU's.
    device = get_accelerator().current_device_name()
    model = add_lora(build_gpt(gpt), spec["model"]).to(device)
    tokens = next(batches)[0].to(device)

    def compute_once() -> float:
        per_micro_batch = vertical_compute(model, tokens, m, repeats=1, synchronize=get_accelerator().synchronize)
        return m * (per_micro_batch["forward_s"] + per_micro_batch["forward_backward_s"])

    print(f"{time.strftime('%H:%M:%S')} replaying {len(windows)} steps' I/O", flush=True)
    floors = step_floors(trace, windows, engine.settings.aio, compute_once, trainable,
                         engine.optimizer.worker_threads)
    if spec.get("trace_path"):
        order = sorted(range(len(windows)), key=lambda i: windows[i][1] - windows[i][0])
        start, end = windows[order[len(order) // 2]]
        write_chrome_trace(trace.window(start, end), spec["trace_path"])
        floors["trace_path"] = spec["trace_path"]
    for r in floors["rounds"]:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                          if not isinstance(v, dict)}), flush=True)
    return floors


def measure_ssd_rates(folder: str, region_mib: int, repeats: int) -> dict:
    """SSD read and write bytes/s through DeepSpeed's aio handle, with the runs' aio block: one large region
    written and read whole, and reads of four regions in flight on one handle; the fastest repeat of each."""
    from ds_greedysnake import deepspeed_compat
    from ds_greedysnake.storage.ssd import IoCounters, SsdStore

    result = {"measured_at": time.time()}
    store = SsdStore(folder, deepspeed_compat.AioSettings(**AIO), IoCounters(), "roofline")
    region = store.create_region("probe", region_mib * MIB, "probe")
    buffer = store.new_buffer(region)
    buffer.fill_(7)
    writes, reads = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        store.write(region, buffer)
        writes.append(time.perf_counter() - started)
        started = time.perf_counter()
        store.read(region, buffer)
        reads.append(time.perf_counter() - started)
    result["ssd_region_bytes"] = region.padded_bytes
    # The fastest repeat, as for compute: the roofline is the best the machine does, and this virtual
    # disk's rates moved by 2x between runs here.
    result["ssd_read_bytes_per_s_one_region"] = region.padded_bytes / min(reads)
    result["ssd_write_bytes_per_s"] = region.padded_bytes / min(writes)
    # Several reads in flight on one handle (ZeRO-Infinity's swapper issues several at once); the
    # roofline takes the faster of the two read rates.
    parts = 4
    regions = [store.create_region(f"part{i}", region.payload_bytes // parts, "probe") for i in range(parts)]
    buffers = [store.new_buffer(r) for r in regions]
    for r, b in zip(regions, buffers):
        store.write(r, b)
    handle = deepspeed_compat.new_aio_handle(deepspeed_compat.AioSettings(**AIO))
    parallel = []
    for _ in range(repeats):
        started = time.perf_counter()
        for r, b in zip(regions, buffers):
            handle.pread(b[:r.padded_bytes], r.path, False, True, 0)
        completed = handle.wait()
        parallel.append(time.perf_counter() - started)
        if completed != parts:
            raise RuntimeError(f"the SSD probe's aio handle completed {completed} of {parts} reads in {folder}")
    result["ssd_read_bytes_per_s_parallel"] = sum(r.padded_bytes for r in regions) / min(parallel)
    result["ssd_read_bytes_per_s"] = max(result["ssd_read_bytes_per_s_one_region"],
                                         result["ssd_read_bytes_per_s_parallel"])
    return result


def measure_machine(spec: dict) -> dict:
    print(f"{time.strftime('%H:%M:%S')} importing", flush=True)
    import torch
    from ab_bench_floor import adam_step_seconds
    from deepspeed.accelerator import get_accelerator
    from ds_greedysnake.models.gpt import build_gpt, lm_loss

    # The compute terms time the engines' compute device: on a GPU the model runs there, timed between
    # synchronizes (the first GPU run timed it on the host's cores instead, 170 s of probe for a
    # roofline of the wrong device).
    device, synchronize = get_accelerator().current_device_name(), get_accelerator().synchronize
    result = {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "compute_device": str(device)}
    folder = spec["nvme_path"]
    result.update(measure_ssd_rates(folder, spec["ssd_region_mib"], spec["ssd_repeats"]))
    # CPU Adam: DeepSpeed's kernel on flat fp32 tensors.
    numel = spec["adam_numel"]
    result["adam_elements_per_s"] = numel / statistics.median(adam_step_seconds(numel, 7)[1:])
    # Compute: plain PyTorch forward (no graph) and forward+backward per micro-batch, per configuration.
    result["compute"] = {}
    for name, model_spec in spec["configs"].items():
        torch.manual_seed(0)
        model = build_gpt(gpt_config(model_spec)).to(device)
        tokens = torch.randint(0, model_spec["vocab"], (model_spec["micro_batch_size"], model_spec["seq_len"]))
        tokens = tokens.to(device)
        forward, forward_backward = [], []
        for _ in range(spec["compute_repeats"] + 1):
            synchronize()
            started = time.perf_counter()
            with torch.no_grad():
                model(tokens)
            synchronize()
            forward.append(time.perf_counter() - started)
            started = time.perf_counter()
            lm_loss(model(tokens), tokens).backward()
            synchronize()
            forward_backward.append(time.perf_counter() - started)
            model.zero_grad(set_to_none=False)  # reuse the gradient buffers, as the engines do
        # The fastest repeat: the roofline is the best the machine does (this machine is shared and noisy).
        result["compute"][name] = {"forward_s": min(forward[1:]), "forward_backward_s": min(forward_backward[1:]),
                                   "vertical": {}}
        for m in spec.get("micro_batches", []):
            result["compute"][name]["vertical"][str(m)] = vertical_compute(model, tokens, m, spec["compute_repeats"],
                                                                          synchronize)
        # The same while another process streams reads and writes through the SSD at full rate: overlapping
        # SSD transfers with compute is what both engines do, and on this virtual machine it slows compute.
        streaming, rate = with_ssd_streaming(
            os.path.join(folder, f"streaming_{name}"),
            lambda: {str(m): vertical_compute(model, tokens, m, spec["compute_repeats"], synchronize)
                     for m in spec.get("micro_batches", [])})
        result["compute"][name]["vertical_streaming"] = streaming
        result["compute"][name]["streaming_bytes_per_s"] = rate
    return result


STREAM_REGION_BYTES = 32 * MIB


def with_ssd_streaming(folder: str, measure):
    """``measure()`` while a child process (``--stream``) keeps one 32 MiB write and one 32 MiB read in
    flight through the aio handle, back to back; returns its result and the bytes/s the child moved."""
    import subprocess

    os.makedirs(folder, exist_ok=True)
    stop = os.path.join(folder, "stop")
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--stream", folder, stop],
                             stdout=subprocess.PIPE, text=True)
    try:
        # DeepSpeed's logger may print to stdout first.
        for line in child.stdout:
            if line.strip() == "streaming":
                break
        else:
            raise RuntimeError(f"the SSD streaming child did not start (exit code {child.wait()})")
        result = measure()
    finally:
        open(stop, "w").close()
        output, _ = child.communicate(timeout=120)
    rates = [line.split()[1] for line in output.splitlines() if line.startswith("bytes_per_s ")]
    if not rates:
        raise RuntimeError(f"the SSD streaming child stopped early (exit code {child.returncode}); see the log")
    return result, float(rates[0])


def stream_ssd(folder: str, stop: str) -> None:
    from ds_greedysnake.deepspeed_compat import AioSettings
    from ds_greedysnake.storage.ssd import IoCounters, SsdStore

    store = SsdStore(folder, AioSettings(**AIO), IoCounters(), "stream")
    regions = [store.create_region(f"r{i}", STREAM_REGION_BYTES, "probe") for i in range(2)]
    buffers = [store.new_buffer(region) for region in regions]
    for region, buffer in zip(regions, buffers):
        store.write(region, buffer)
    print("streaming", flush=True)
    moved, started = 0, time.perf_counter()
    parent = os.getppid()
    while not os.path.exists(stop) and os.getppid() == parent:  # stop with the probe, or if it is gone
        for writing in (0, 1):
            store.start_write(regions[writing], buffers[writing])
            store.start_read(regions[1 - writing], buffers[1 - writing])
            store.wait()
            moved += 2 * regions[0].padded_bytes
    print(f"bytes_per_s {moved / (time.perf_counter() - started)}", flush=True)
    os._exit(0)  # skip DeepSpeed's native teardown (see main)


def vertical_compute(model, tokens, num_micro_batches: int, repeats: int, synchronize=lambda: None) -> dict:
    """Plain PyTorch in the vertical order, weights resident: every micro-batch through one layer before
    the next, then backward layer by layer with a recompute. A layer's weights stay in cache across the
    micro-batches, so per micro-batch this can beat the whole-model pass; the roofline takes the faster.
    Seconds per micro-batch, the fastest repeat; ``synchronize`` waits for the device (on a GPU: the
    accelerator's synchronize, so that the times are of the work, not of queueing it)."""
    import torch
    from ds_greedysnake.models.gpt import lm_loss

    layers = list(model)
    # Backward stops at the lowest layer with something to train, as the engine's does (a frozen embedding
    # under LoRA needs no input gradient and no backward).
    lowest = next((i for i, layer in enumerate(layers) if any(p.requires_grad for p in layer.parameters())),
                  len(layers) - 1)
    forward, forward_backward = [], []
    for _ in range(repeats + 1):
        synchronize()
        started = time.perf_counter()
        inputs = [[tokens] * num_micro_batches]  # inputs[l][mb]: layer l's input
        with torch.no_grad():
            for layer in layers[:-1]:
                inputs.append([layer(value) for value in inputs[-1]])
        synchronize()
        forward.append(time.perf_counter() - started)
        started = time.perf_counter()
        output_grads = [None] * num_micro_batches
        for index in range(len(layers) - 1, lowest - 1, -1):
            for mb in range(num_micro_batches):
                layer_input = inputs[index][mb]
                if index > lowest:
                    layer_input = layer_input.detach().requires_grad_(True)
                output = layers[index](layer_input)
                if index == len(layers) - 1:
                    (lm_loss(output, tokens) / num_micro_batches).backward()
                else:
                    output.backward(output_grads[mb])
                output_grads[mb] = layer_input.grad if index > lowest else None
        synchronize()
        forward_backward.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=False)
    return {"forward_s": min(forward[1:]) / num_micro_batches,
            "forward_backward_s": min(forward_backward[1:]) / num_micro_batches}


def main(spec_path: str) -> None:
    if spec_path == "--stream":
        stream_ssd(*sys.argv[2:4])
    with open(spec_path) as handle:
        spec = json.load(handle)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    result_path = spec["result_path"]
    if world_size > 1:  # one result per rank; the parent merges them
        result_path = result_path.replace(".json", f".rank{os.environ['RANK']}.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    try:
        if spec["kind"] == "engine":
            result = run_engine(spec)
        elif spec["kind"] == "ssd":
            result = measure_ssd_rates(spec["nvme_path"], spec["ssd_region_mib"], spec["ssd_repeats"])
        else:
            result = measure_machine(spec)
    except BaseException:
        # Leave now: DeepSpeed's native teardown has hung this process after an exception.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    with open(result_path, "w") as handle:
        json.dump(result, handle, indent=1)
    # DeepSpeed's native threads have aborted this process at exit ("terminate called without an
    # active exception") after a complete run; the result is written, so skip the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
