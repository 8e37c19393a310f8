"""The planner's probes of ZeRO-Infinity: what its terms cannot get from the machine's plain rates.

    rates = probe_zero_ops(folder, settings.aio, sizes)          # ZeRO-3's aio ops, by size, into locked buffers
    terms = probe_zero_engine(ds_config, workload, folder)      # ZeRO-3 itself on four of the model's blocks
    terms = probe_zero_engine(ds_config, workload, folder, processes=2)  # the same in two processes, averaged

A profile of ab_bench's ZeRO-Infinity (docs/planner.md, "The planner on shapes it never ran on") showed its
costs far from what the plain rates give, by different factors at hidden 384 and 768: its parameter reads
(one ``swap_in`` per tensor into a locked buffer: 2.3 GB/s where the probe's one 128 MiB pageable op gave
0.95), its forwards and backwards besides the reads (its hooks, gathers and releases around every layer:
2.2x and 5.5x the same layers' plain compute), its gradient reduction (0.64-0.68x the rate of a reduction
of 8 large pieces), its Adam, one call per sub-group (0.3-0.4x DeepSpeedCPUAdam's rate on one large
tensor), and its swappers' work around each aio op. ``probe_zero_ops`` times the ops at the model's sizes;
``probe_zero_engine`` runs the baseline as ab_bench runs it (ds_config's ZeRO-3 with NVMe parameters and
optimizer states, activation checkpointing around each block) on the model's hidden size, vocabulary,
sequence and micro-batch size with four blocks, in a child process (zero.Init patches torch for the whole
process), and times its parts with ``deepspeed_compat.profile_zero_step``:

* ``zero_read_seconds_by_size``: each parameter read (``swap_in``: its aio op and the swapper's own work)
  by size, the median seconds; the probe's model has the model's embedding, head and block tensors, so
  every size the model reads;
* ``zero_seconds_per_fetch``: (the passes' wall time - parameter reads - reductions - the plain compute of
  the same layers, timed in the child before zero.Init) / the layer fetches, added to each fetch's compute;
* ``zero_grad_reduce_elements_per_s``: parameters / a micro-batch's reduction but the last; the last's, less
  the gradient write it holds, as "gradient reduction (boundary)" per element (it also moves the accumulated
  gradients to the optimizer: 0.25 s against 0.10 s for the others at hidden 640 here);
* ``zero_reduction_parts_seconds_per_element``: the reduction's parts (``reduction_parts``), no term of the
  model: what scripts/bench/zero_reduction_profile.py sets against a run's;
* ``zero_optimizer_seconds_per_element``: each part of the optimizer step (the swapped states' reads and
  writes, Adam, the new weights, and the rest of the step) and the boundary's gradient write, seconds per
  element it works on (``optimizer_elements``): the probe's optimizer has the model's sub-groups, fewer of
  them; the swapper's copies and waits are in them (an aio op alone gave the new weights' write at half the
  profiled time).
"""
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

import torch

from .. import deepspeed_compat
from ..settings import Settings, settings_from_ds_config
from ..storage.ssd import ALIGNMENT
from .cost_model import Workload
from .errors import PlannerError
from .zero_model import HorizontalSettings, zero_sub_groups, zero_swapped_tensors

MIB = 2**20

BLOCKS = 4
MICRO_BATCHES = 2
STEPS = 5          # measured, after one warm-up step


def probe_zero_engine(ds_config: Dict, workload, folder: str, timeout: float = 600.0,
                      blocks: int = BLOCKS, processes: int = 1) -> Dict[str, float]:
    """Run the child on ``workload``'s shape (four blocks) with ``ds_config``'s ZeRO-3 and aio settings, its
    NVMe folders under ``folder``; the three terms above. With ``processes`` > 1, the child runs that many
    times, one after another, and each term is the mean of theirs (``mean_terms``): on this project's VM a
    process's ZeRO-3 state reads ran at one of two speeds, 1.5-2x apart, by where its swap buffers landed in
    memory (docs/planner.md, "Why a run's disk rate moved"), so one process's draw can put a run of the
    other 2x off on that term."""
    if processes < 1:
        raise PlannerError(f"the ZeRO-3 probe needs at least one process, got {processes}")
    return mean_terms([_probe_once(ds_config, workload, folder, timeout, blocks) for _ in range(processes)])


def _probe_once(ds_config: Dict, workload, folder: str, timeout: float, blocks: int) -> Dict[str, float]:
    shape = workload.shape
    spec = {"ds_config": ds_config, "hidden": shape.hidden, "heads": shape.heads, "vocab": shape.vocab,
            "seq_len": shape.seq_len, "mlp_ratio": shape.mlp_ratio, "micro_batch_size": workload.micro_batch_size,
            "bf16": workload.param_bytes == 2, "folder": folder, "blocks": blocks}
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zero_probe_", dir=folder) as scratch:
        spec["folder"] = scratch
        spec_path, out_path = os.path.join(scratch, "spec.json"), os.path.join(scratch, "out.json")
        with open(spec_path, "w") as handle:
            json.dump(spec, handle)
        with socket.socket() as sock:  # a free port for the child's one-rank process group
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                   WORLD_SIZE="1")
        done = subprocess.run([sys.executable, "-m", "ds_greedysnake.planner.zero_probe", spec_path, out_path],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if done.returncode != 0 or not os.path.exists(out_path):
            raise PlannerError(f"the ZeRO-3 probe failed (exit status {done.returncode}); its output ends:\n"
                               + done.stdout[-3000:])
        with open(out_path) as handle:
            terms = json.load(handle)
    terms["zero_read_seconds_by_size"] = {int(size): seconds  # JSON's keys are strings
                                          for size, seconds in terms["zero_read_seconds_by_size"].items()}
    return terms


def mean_terms(runs: Sequence[Dict]) -> Dict:
    """The terms of several probe processes as one: each cost (seconds per fetch, per element, per read of a
    size) the mean of theirs, the reduction rate the one of their mean seconds per element; the expected
    cost of a process whose draw is not known. One process's terms come back as they are."""
    if len(runs) == 1:
        return runs[0]
    mean = statistics.fmean
    combined = {key: mean(run[key] for run in runs) for key in ("zero_seconds_per_fetch", "passes_seconds",
                                                               "plain_compute_seconds")}
    combined["fetches"] = runs[0]["fetches"]
    combined["zero_grad_reduce_elements_per_s"] = 1.0 / mean(1.0 / run["zero_grad_reduce_elements_per_s"]
                                                             for run in runs)
    tables = ["zero_optimizer_seconds_per_element", "zero_read_seconds_by_size"]
    if all("zero_reduction_parts_seconds_per_element" in run for run in runs):  # a diagnosis, not a term
        tables.append("zero_reduction_parts_seconds_per_element")
    for table in tables:
        combined[table] = {key: mean(run[table][key] for run in runs) for key in runs[0][table]}
    combined["processes"] = len(runs)
    return combined


def zero_op_sizes(workload: Workload, settings: Settings) -> Tuple[List[int], List[int]]:
    """(read sizes, write sizes) in bytes of the aio ops ZeRO-3's swappers issue for ``workload``'s model:
    its swapped parameter tensors (reads and writes), and each swapped optimizer sub-group's fp32 states
    and per-parameter gradients (``zero_model.zero_optimizer_seconds``)."""
    zero = HorizontalSettings.from_settings(settings)
    params = {workload.param_bytes * numel for layer in workload.shape.layers
              for numel in zero_swapped_tensors(layer, workload.param_bytes, zero)}
    states, gradients = set(), set()
    for group in zero_sub_groups(workload.shape.layers, zero):
        if 4 * sum(group) >= zero.min_swap_bytes:
            states.add(4 * sum(group))
            gradients.update(4 * numel for numel in group)
    return sorted(params | states | gradients), sorted(params | states | gradients)


def probe_zero_ops(folder: str, aio: deepspeed_compat.AioSettings, sizes: Sequence[int],
                   min_seconds: float = 2.0, most_sizes: int = 8) -> Dict[str, object]:
    """One aio op at a time, as ZeRO-3's swappers issue a tensor, into buffers locked by the handle as theirs
    are (``deepspeed_compat.zero_swap_buffer``), at the model's own op sizes (at most ``most_sizes`` of them,
    spread from the smallest to the largest), round after round for ``min_seconds``: each size's median
    seconds (``ssd_*_seconds_by_op_size``; ``cost_model.op_seconds`` interpolates between sizes), and the largest
    one's rate as ``ssd_*_bytes_per_s_single``. Medians per size, not a line: over the 0.6-2.4 MB ops of hidden
    384 a line through two seconds of this disk's jitter gave a write rate of 86 GB/s. Into pageable buffers
    (the probe before) hidden 768's ops ran at 1.2-1.5 GB/s, into locked ones at 2.4-2.8, and ZeRO-3's own
    reads of them at 2.3 GB/s (docs/planner.md, "The planner on shapes it never ran on")."""
    # Capped at 256 MiB (an optimizer sub-group's states can be the whole model's): beyond, the largest's rate.
    sizes = sorted({min(256 * MIB, max(ALIGNMENT, -(-size // ALIGNMENT) * ALIGNMENT)) for size in sizes})
    if len(sizes) > most_sizes:
        sizes = sorted({sizes[round(i * (len(sizes) - 1) / (most_sizes - 1))] for i in range(most_sizes)})
    os.makedirs(folder, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="planner_zero_ops_", dir=folder)
    handle = deepspeed_compat.new_aio_handle(aio)
    buffers = []
    timings = {"read": {size: [] for size in sizes}, "write": {size: [] for size in sizes}}
    try:
        buffers.extend(deepspeed_compat.zero_swap_buffer(handle, size) for size in sizes)
        paths = [os.path.join(scratch, f"op{size}.swp") for size in sizes]

        def one_op(kind: str, buffer: torch.Tensor, path: str) -> float:
            started = time.perf_counter()
            (handle.pread if kind == "read" else handle.pwrite)(buffer, path, False, True, 0)
            if handle.wait() != 1:
                raise OSError(f"aio probe: a {kind} of {buffer.numel()} bytes to {path} did not complete")
            return time.perf_counter() - started

        for buffer, path in zip(buffers, paths):  # the files, and a warm-up round
            buffer.fill_(7)
            one_op("write", buffer, path)
            one_op("read", buffer, path)
        # Reads in rounds of their own, as ZeRO-3's forwards and backwards read without writing (a read right
        # after a write of the same file ran 5-10% slower here).
        started, rounds = time.perf_counter(), 0
        while rounds < 5 or time.perf_counter() - started < min_seconds:
            rounds += 1
            for kind in ("read", "write"):
                for size, buffer, path in zip(sizes, buffers, paths):
                    timings[kind][size].append(one_op(kind, buffer, path))
    finally:
        for buffer in buffers:
            handle.free_cpu_locked_tensor(buffer)
        shutil.rmtree(scratch, ignore_errors=True)
    rates = {}
    for kind, by_size in timings.items():
        medians = {size: statistics.median(times) for size, times in by_size.items()}
        rates[f"ssd_{kind}_seconds_by_op_size"] = medians
        rates[f"ssd_{kind}_bytes_per_s_single"] = sizes[-1] / medians[sizes[-1]]
    return rates


def _ds_config(spec: dict) -> dict:
    """The user's ds_config with M = 2, the spec's micro-batch size and every NVMe path in the scratch folder."""
    ds = json.loads(json.dumps(spec["ds_config"]))
    ds.pop("train_batch_size", None)
    ds["train_micro_batch_size_per_gpu"] = spec["micro_batch_size"]
    ds["gradient_accumulation_steps"] = MICRO_BATCHES
    ds.pop("greedysnake", None)  # DeepSpeed's own engine
    zero = ds.setdefault("zero_optimization", {})
    for key in ("offload_param", "offload_optimizer"):
        if isinstance(zero.get(key), dict) and zero[key].get("device") == "nvme":
            zero[key]["nvme_path"] = spec["folder"]
    return ds


# The optimizer's parts, as deepspeed_compat.profile_zero_step names them, timed per element.
OPTIMIZER_PARTS = ("optimizer state read", "Adam", "parameter write", "optimizer state write",
                   "gradient write (boundary)")


def reduction_parts(ops: Dict[str, float], micro_batches: int, params: int) -> Dict[str, float]:
    """A step's gradient reductions (``deepspeed_compat.profile_zero_step``'s seconds ``ops``) in parts, seconds
    per element of a micro-batch's gradients: the bucket's reduce-scatter (flattened, divided, reduce-scattered),
    the copies or adds of each partition into its buffer, the rest of the reduction (bucket bookkeeping), and
    the boundary's norms per element of the model (the boundary's gradient write is its own optimizer part).
    What scripts/bench/zero_reduction_profile.py sets a run's against the probe's."""
    per_micro_batch = micro_batches * params
    partition = ops["gradient partition"] - ops["gradient norm (boundary)"] - ops["gradient write (boundary)"]
    return {"reduce-scatter": ops["gradient reduce-scatter"] / per_micro_batch,
            "partition copies": partition / per_micro_batch,
            "rest": (ops["gradient reduction"] - ops["gradient reduce-scatter"] - ops["gradient partition"])
            / per_micro_batch,
            "norm (boundary)": ops["gradient norm (boundary)"] / params}


def optimizer_elements(shape, zero) -> Dict[str, int]:
    """Per part of ZeRO-3's optimizer step, the elements it works on: the states and gradients of the swapped
    sub-groups, every parameter for Adam and the new weights (their swapped tensors written, the rest
    copied)."""
    swapped = sum(sum(group) for group in zero_sub_groups(shape.layers, zero) if 4 * sum(group) >= zero.min_swap_bytes)
    return {"optimizer state read": swapped, "optimizer state write": swapped, "gradient write (boundary)": swapped,
            "Adam": shape.params, "parameter write": shape.params}


def _run(spec: dict) -> Dict[str, float]:
    import deepspeed

    from ..models.gpt import GPTConfig, build_gpt, lm_loss, micro_batches, synthetic_corpus
    from .timing import probe_layers
    from .shapes import GPTShape

    deepspeed_compat.remove_shm_buffer_at_exit()
    blocks = spec.get("blocks", BLOCKS)
    shape = GPTShape("zero probe", blocks, spec["hidden"], spec["heads"], spec["vocab"], spec["seq_len"],
                     spec["mlp_ratio"])
    workload = Workload(shape, spec["micro_batch_size"], MICRO_BATCHES, 2 if spec["bf16"] else 4,
                        2 if spec["bf16"] else 4)
    device = deepspeed_compat.accelerator_device()
    plain = probe_layers(workload, device, repeats=3)  # before zero.Init patches torch
    plain_compute = sum(plain[layer.kind].forward_backward_s + (plain[layer.kind].forward_s if layer.checkpointed else 0.0)
                        for layer in shape.layers)  # forward, then backward (a block's with its recompute)
    ds = _ds_config(spec)
    config = GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq_len, hidden=shape.hidden, num_heads=shape.heads,
                       num_layers=blocks, mlp_ratio=shape.mlp_ratio)
    deepspeed.init_distributed(dist_backend=deepspeed_compat.get_accelerator().communication_backend_name())
    deepspeed.checkpointing.configure(None, deepspeed_config=ds)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = deepspeed_compat.zero_checkpointed_gpt(build_gpt(config))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    batches = micro_batches(synthetic_corpus(20_000, shape.vocab, 0), spec["micro_batch_size"], shape.seq_len, 0)
    steps, read_seconds = [], {}
    for index in range(1 + STEPS):
        phases = {}
        with deepspeed_compat.profile_zero_step() as profile, deepspeed_compat.count_zero_param_swap_reads() as reads, \
                deepspeed_compat.time_engine_phases(engine, phases, MICRO_BATCHES):
            for _ in range(MICRO_BATCHES):
                inputs, labels = next(batches)
                loss = lm_loss(engine(inputs.to(device)), labels.to(device))
                engine.backward(loss)
                engine.step()
        if index:
            # One reduction per micro-batch; the boundary's (the last) also moves the accumulated gradients to
            # the optimizer's buffers and holds the gradient write.
            reductions = profile.durations["gradient reduction"]
            steps.append((phases, dict(profile.seconds, **{
                "reduction (not boundary)": statistics.mean(reductions[:-1]),
                "reduction (boundary)": reductions[-1] - profile.seconds["gradient write (boundary)"]})))
            if len(profile.durations["parameter read"]) != len(reads.call_bytes):
                raise RuntimeError("the ZeRO-3 probe could not pair its parameter reads with their sizes")
            for size, seconds in zip(reads.call_bytes, profile.durations["parameter read"]):
                read_seconds.setdefault(size, []).append(seconds)
    fetches = sum(3 if layer.checkpointed else 2 for layer in shape.layers)  # forward, (recompute,) backward
    params = shape.params

    def median(of) -> float:
        return statistics.median(of(phases, ops) for phases, ops in steps)

    reduction = median(lambda phases, ops: ops["reduction (not boundary)"])
    passes = median(lambda phases, ops: phases["forward"] + phases.get("backward", 0.0)
                    + phases.get("backward (boundary)", 0.0) - ops["parameter read"] - ops["gradient reduction"])
    elements = optimizer_elements(shape, HorizontalSettings.from_settings(settings_from_ds_config(ds)))
    per_element = {part: median(lambda phases, ops: ops[part]) / elements[part] for part in OPTIMIZER_PARTS
                   if elements[part]}
    per_element["gradient reduction (boundary)"] = median(lambda phases, ops: ops["reduction (boundary)"]) / params
    per_element["optimizer step, beyond its parts"] = median(
        lambda phases, ops: ops["optimizer step"] - sum(ops[part] for part in OPTIMIZER_PARTS
                                                        if part != "gradient write (boundary)")) / params
    parts = [reduction_parts(ops, MICRO_BATCHES, params) for _, ops in steps]
    return {"zero_seconds_per_fetch": max(0.0, passes - MICRO_BATCHES * plain_compute) / (MICRO_BATCHES * fetches),
            "zero_grad_reduce_elements_per_s": params / max(reduction, 1e-9),
            "zero_optimizer_seconds_per_element": per_element,
            "zero_reduction_parts_seconds_per_element": {name: statistics.median(step[name] for step in parts)
                                                         for name in parts[0]},
            "zero_read_seconds_by_size": {size: statistics.median(times) for size, times in read_seconds.items()},
            "passes_seconds": passes, "plain_compute_seconds": MICRO_BATCHES * plain_compute, "fetches": fetches}


if __name__ == "__main__":
    with open(sys.argv[1]) as spec_file:
        result = _run(json.load(spec_file))
    with open(sys.argv[2], "w") as out_file:
        json.dump(result, out_file)
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's native threads have aborted at interpreter exit (ab_bench's children do the same)
