"""The A/B benchmark's step floor for a greedysnake run, measured from the run itself (docs/ab_bench.md).

Each measured step is recorded (``engine.start_io_trace``), and once the run is closed, each step's record
is replayed on the run's own files with no compute and no Adam (``io_replay.replay``): the step's I/O
floor on this disk at this moment. Right after each replay, the same model's compute alone (plain PyTorch
in the vertical order, ``ab_bench_child.vertical_compute``) and DeepSpeed's CPU Adam alone over the
trainable parameters, on the optimizer worker's thread count, are timed once each. A round is one step
with its three floors; the floor is the largest of the three. Compute and Adam run on the same cores on
this machine (the training threads and the worker's), so the floor where they cannot overlap,
max(I/O, compute + Adam), is reported beside it.

Which clock times the compute: the floor's compute alone (``vertical_compute`` with the accelerator's
``synchronize`` before each clock reading) is the device's work on a GPU, not the host's launches; the
step's breakdown (``io_trace.time_breakdown``) takes the device's time of each compute op off the CPU
(timing events on the compute stream) and says so in ``compute_clock``, which the report prints.
"""
import statistics
import time
from typing import List, Optional


def adam_step_seconds(numel: int, steps: int, threads: Optional[int] = None) -> List[float]:
    """Seconds of each of ``steps`` DeepSpeed CPU Adam steps over ``numel`` fp32 elements (the first warms up),
    on ``threads`` threads (default: this process's)."""
    import torch
    from ds_greedysnake.deepspeed_compat import AdamHyperparameters, CpuAdamKernel

    hyper = AdamHyperparameters(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    kernel = CpuAdamKernel(hyper, adamw_mode=True)
    tensors = [torch.randn(numel) for _ in range(4)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        times = []
        for step in range(1, steps + 1):
            started = time.perf_counter()
            kernel.update(step, hyper, *tensors)
            times.append(time.perf_counter() - started)
        return times
    finally:
        torch.set_num_threads(previous)


def step_floors(trace, windows, aio, compute_once, trainable: int, adam_threads: int) -> dict:
    """Per round (one measured step): the replay of its record, the compute alone, Adam alone, the
    floor and the step's time against it; ``aio``: the run's ``engine.settings.aio``; ``windows``: (start, end)
    of each measured step;
    ``compute_once()``: seconds of the step's compute in the vertical order."""
    from ds_greedysnake.storage.io_replay import replay
    from ds_greedysnake.storage.io_trace import time_breakdown

    rounds = []
    for index, (start, end) in enumerate(windows):
        # The step and what it left in flight, up to the next step's start (the last: the trace's end).
        until = windows[index + 1][0] if index + 1 < len(windows) else float("inf")
        window = trace.window(start, until)
        replayed = replay(window, aio)
        compute = compute_once()
        adam = adam_step_seconds(trainable, 2, adam_threads)[1]
        floors = {"io_replay": replayed.seconds, "compute": compute, "adam": adam}
        floor = max(floors.values())
        shared = max(replayed.seconds, compute + adam)
        step = end - start
        rounds.append({
            "step_s": step, "io_replay_s": replayed.seconds, "compute_s": compute, "adam_s": adam,
            "floor_s": floor, "floor_is": max(floors, key=floors.get), "step_over_floor": step / floor,
            "shared_cores_floor_s": shared, "step_over_shared_cores_floor": step / shared,
            "replay_read_bytes": replayed.bytes_read, "replay_write_bytes": replayed.bytes_written,
            "replay_bytes_per_s": replayed.bytes_per_s, "replay_seconds_by_process": replayed.seconds_by_process,
            "breakdown": time_breakdown(trace.window(start, end), start, end),
            "transfer_sizes": transfer_sizes(window),
        })
    median = lambda key: statistics.median(r[key] for r in rounds)  # noqa: E731
    return {"rounds": rounds, **{f"{key}_median": median(key) for key in (
        "step_s", "io_replay_s", "compute_s", "adam_s", "floor_s", "step_over_floor", "shared_cores_floor_s",
        "step_over_shared_cores_floor", "replay_bytes_per_s")},
        "breakdown_mean": {**{part: statistics.mean(r["breakdown"][part] for r in rounds)
                              for part in ("compute", "ssd_wait", "worker_wait", "rest", "total")},
                           # The clock of the compute figure: the host's on the CPU, the device's off it
                           # (io_trace.time_breakdown); "mixed" where rounds disagree.
                           "compute_clock": _one_clock(r["breakdown"]["compute_clock"] for r in rounds)}}


def _one_clock(clocks) -> str:
    distinct = set(clocks)
    return distinct.pop() if len(distinct) == 1 else "mixed"


def transfer_sizes(window) -> dict:
    """Bytes moved per (read or write, transfer size in MiB rounded to 0.1): what ssd_rates.py should measure."""
    sizes = {}
    for event in window.events:
        if event.kind == "issue":
            key = f"{event.op} {event.bytes / 2**20:.1f}"
            sizes[key] = sizes.get(key, 0) + event.bytes
    return dict(sorted(sizes.items(), key=lambda item: -item[1]))
