"""The planner's command line: the recommended greedysnake block, predicted step times of both engines,
and the SSD bytes that block needs per kind (what initialize will log and check), with the free space.

    python -m ds_greedysnake.plan --config ds_config.json --model gpt-small              # probes this machine
    python -m ds_greedysnake.plan --config ds_config.json --model gpt-65b --hardware configs/hardware/a100_pcie4.json
    python -m ds_greedysnake.plan --config ds_config.json --layers blocks=2,hidden=1024,heads=8,vocab=2048,seq_len=32 --json
"""
import argparse
import contextlib
import json
import os
import shutil
import sys
from typing import Optional, Tuple

from ..config import GreedySnakeConfigError
from .errors import PlannerError
from .hardware import load_hardware, read_json, save_hardware
from .plan_config import PlanRequest, budget_bytes, plan_for_settings, workload_from_settings
from .search import GIB
from .shapes import lora_numels, named_shape, parse_layers
from .ssd_space import ssd_bytes
from ..settings import Settings, settings_from_ds_config
from ..storage.ssd_layout import describe

MIB = 2**20
NOT_IMPLEMENTED = ("parameters and optimizer states stay on SSD: host-resident shares of them are modelled "
                   "(--modelled-placements) but not implemented by the engine yet")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ds_greedysnake.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the ds_config.json to plan for")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="a named model shape (default gpt-small); see --list-models")
    which.add_argument("--layers", default=None, help="a GPT shape: blocks=N,hidden=H,heads=A,vocab=V,seq_len=S")
    parser.add_argument("--hardware", default="probe", help="'probe' (measure this machine) or a hardware JSON file")
    parser.add_argument("--host-memory", type=float, default=None, help="host-memory budget in GiB "
                        "(default: half the hardware's host memory)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=None,
                        help="the M to consider (default 1 2 4 ... 64 and the config's)")
    parser.add_argument("--modelled-placements", action="store_true",
                        help="let parameters and optimizer states sit in host memory (modelled, not implemented)")
    parser.add_argument("--ideal", action="store_true",
                        help="the paper's model (alpha split, every transfer overlapped) instead of the engine as it is")
    parser.add_argument("--zero-no-recompute", action="store_true",
                        help="the ZeRO-Infinity baseline runs without activation checkpointing "
                             "(as scripts/train.py --baseline does; scripts/bench/ab_bench/ab_bench.py checkpoints)")
    parser.add_argument("--no-zero-probe", action="store_true",
                        help="skip running ZeRO-3 itself on four of the model's blocks (20-60 s; zero_probe.py): "
                             "ZeRO-Infinity's prediction then lacks its per-layer overhead and takes its reduction and "
                             "Adam from plain rates (docs/planner.md, \"The planner on shapes it never ran on\")")
    parser.add_argument("--zero-probe-processes", type=int, default=1, metavar="N",
                        help="run the ZeRO-3 probe in N processes, one after another, each of its terms the mean of "
                             "theirs (a process's ZeRO-3 state reads ran at one of two speeds on the project's VM: "
                             "docs/planner.md, \"Why a run's disk rate moved\")")
    parser.add_argument("--nvme-path", default=None, help="folder the probe measures (default: the config's nvme_path)")
    parser.add_argument("--save-hardware", default=None, help="write the probed hardware to this JSON file")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    parser.add_argument("--lora", type=int, default=None, metavar="R",
                        help="the SSD space of a LoRA run: rank-R adapters on every block matrix, the base frozen "
                             "(the step-time plans stay those of full training)")
    parser.add_argument("--saturated", action="store_true",
                        help="per engine, tokens/s as the global batch grows over every micro-batch size and M that "
                             "fit the device, the saturation point and the ratio of the saturated throughputs")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=None,
                        help="with --saturated: the micro-batch sizes to sweep (default 1 2 4 ... 64)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="with --saturated: data-parallel ranks sharing this machine's SSD, CPU and host memory")
    return parser.parse_args(argv)


@contextlib.contextmanager
def _stdout_to_stderr_if(enabled: bool):
    """Point file descriptor 1 at stderr for a while (Python loggers and native code alike)."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


# --saturated compares plateaus, where compute binds: its probe times the layers 5x longer than a plan's.
# A block's forward and backward at 16 x 32 tokens here, five probes in one process: 38.7-43.6 ms with
# 5 repeats, 40.3-41.3 ms with 25 (docs/planner.md, 2026-12-02).
SATURATED_LAYER_REPEATS = 25


def _load_settings(path: str) -> Tuple[dict, Settings]:
    """The --config file, and its settings parsed as ``initialize`` parses them
    (``settings.settings_from_ds_config``); the dict goes whole to the ZeRO-3 probe's DeepSpeed engine."""
    ds_config = read_json(path, "--config")
    try:
        return ds_config, settings_from_ds_config(ds_config)
    except GreedySnakeConfigError as error:
        raise PlannerError(f"--config {path}: {error}") from None


def _hardware(args, ds_config: dict, settings: Settings, shape):
    if args.hardware != "probe":
        return load_hardware(args.hardware)
    from .probe import probe_machine, timeable  # imports torch and DeepSpeed's ops: only when probing
    nvme_path = args.nvme_path or settings.zero.nvme_path
    workload = workload_from_settings(settings, shape)
    # Time the layers where they fit easily in memory (every micro-batch size of a --saturated sweep);
    # otherwise fall back to FLOP/s.
    timed = workload if timeable(workload) else None
    sizes = _sweep_sizes(args) if args.saturated else ()
    hardware = probe_machine(nvme_path, settings, timed, more_micro_batch_sizes=sizes,
                             layer_repeats=SATURATED_LAYER_REPEATS if args.saturated else None,
                             zero_ds_config=None if args.no_zero_probe or timed is None else ds_config,
                             zero_probe_processes=args.zero_probe_processes)
    if args.save_hardware:
        save_hardware(hardware, args.save_hardware)
    return hardware


def _describe(plans, hardware, shape, workload, budget, request) -> str:
    best = plans[0]
    gs, zi = best.prediction, best.zero_infinity
    lines = [
        f"model {shape.name}: {shape.params / 1e6:.1f}M parameters, {len(shape.layers)} layers as the engine splits "
        f"it, micro-batch {workload.micro_batch_size} x {shape.seq_len} tokens, {8 * workload.param_bytes}-bit",
        f"hardware {hardware.name} ({hardware.source}): SSD read {hardware.ssd_read_bytes_per_s / MIB:.0f} MiB/s, "
        f"write {hardware.ssd_write_bytes_per_s / MIB:.0f} MiB/s (one op per transfer: "
        f"{hardware.ssd_read_bytes_per_s_single / MIB:.0f} and {hardware.ssd_write_bytes_per_s_single / MIB:.0f});"
        f" CPU Adam {hardware.adam_elements_per_s / 1e6:.0f} M elements/s; device "
        f"{hardware.device_flops_per_s / 1e9:.1f} GFLOP/s; host link "
        + ("none (the device is the host)" if hardware.host_device_bytes_per_s is None
           else f"{hardware.host_device_bytes_per_s / 1e9:.1f} GB/s"),
        f"host-memory budget {budget / GIB:.2f} GiB; model: "
        + ("the paper's ideal (alpha split)" if request.ideal else "the engine as it runs today"),
        "",
        f"recommended (the smallest M within 95% of the best predicted tokens/s): M = {best.micro_batches}",
        f'  "gradient_accumulation_steps": {best.micro_batches},',
        f'  "greedysnake": {json.dumps(best.greedysnake_block()) if not request.ideal else "(ideal model: not an engine config)"}',
        f"  greedysnake:   {gs.seconds:.3f} s/step, {gs.tokens_per_second:.1f} tokens/s, binds: {gs.binding} "
        f"({gs.seconds_by_binding[gs.binding]:.3f} s of the step)",
        f"  ZeRO-Infinity: {zi.seconds:.3f} s/step, {zi.tokens_per_second:.1f} tokens/s, binds: {zi.binding} "
        f"({zi.seconds_by_binding[zi.binding]:.3f} s of the step)",
        f"  predicted speed-up {zi.seconds / gs.seconds:.2f}x; host memory {best.host_bytes / GIB:.2f} GiB "
        f"(shares in host memory: {', '.join(f'{k} {v:.2f}' for k, v in best.shares.items())}; "
        f"optimizer states of the first {best.optimizer_host_layers} layer(s))",
        "",
        "| M | greedysnake s | tokens/s | binds | ZeRO-Infinity s | tokens/s | binds | speed-up | split | host GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for plan in sorted(plans, key=lambda p: p.micro_batches):
        g, z = plan.prediction, plan.zero_infinity
        split = plan.deferred_layers if plan.alpha is None else f"alpha {plan.alpha:.3f}"
        lines.append(f"| {plan.micro_batches} | {g.seconds:.3f} | {g.tokens_per_second:.1f} | {g.binding} | "
                     f"{z.seconds:.3f} | {z.tokens_per_second:.1f} | {z.binding} | {z.seconds / g.seconds:.2f}x | "
                     f"{split} | {plan.host_bytes / GIB:.2f} |")
    if not request.modelled_shares:
        lines += ["", f"note: {NOT_IMPLEMENTED}."]
    else:
        lines += ["", "note: MODELLED placements: host-resident parameters / optimizer states are not implemented "
                      "by the engine; apply only the checkpoint budget of this plan."]
    return "\n".join(lines)


def _sweep_saturated(args, settings: Settings, request: PlanRequest) -> dict:
    from .zero_model import HorizontalSettings
    from .engine_model import EngineSettings
    from .saturation import DEFAULT_SWEEP_MICRO_BATCHES, SweepRequest, sweep
    width = workload_from_settings(settings, request.shape).param_bytes
    block = settings.greedysnake
    depth = block.prefetch_depth if block.prefetch else 1
    return sweep(SweepRequest(
        request.shape, request.hardware, budget_bytes(request),
        zero_settings=HorizontalSettings.from_settings(settings, recompute=request.zero_recompute),
        engine_settings=EngineSettings.from_settings(settings),
        micro_batch_sizes=_sweep_sizes(args),
        micro_batches=args.micro_batches or DEFAULT_SWEEP_MICRO_BATCHES, ranks=args.ranks, dtype_bytes=width,
        ideal=request.ideal, prefetch_depth=depth))


def _sweep_sizes(args):
    """The micro-batch sizes ``--saturated`` sweeps (and its probe times)."""
    from .saturation import DEFAULT_MICRO_BATCH_SIZES
    return args.micro_batch_sizes or DEFAULT_MICRO_BATCH_SIZES


def _saturated_json(shape, hardware, saturations: dict) -> dict:
    from .saturation import saturated_ratio
    return {"model": shape.name, "hardware": hardware.to_dict(), "ratio": saturated_ratio(saturations),
            "saturations": {engine: saturation.to_dict() for engine, saturation in saturations.items()}}


def _describe_saturated(shape, hardware, request: PlanRequest, saturations: dict) -> str:
    from .saturation import saturated_ratio
    names = {"greedysnake": "greedysnake" + (" (the paper's ideal model)" if request.ideal else " (the engine)"),
             "zero_infinity": "ZeRO-Infinity"}
    device = ("unknown: every configuration fits (the device is the host)" if hardware.device_memory_bytes is None
              else f"{hardware.device_memory_bytes / GIB:.1f} GiB")
    lines = [f"model {shape.name}: saturated throughput on {hardware.name}; device memory {device}; "
             f"greedysnake's host-memory budget {budget_bytes(request) / GIB:.2f} GiB"]
    for engine, saturation in saturations.items():
        plateau, knee = saturation.plateau, saturation.saturation_point
        lines += ["", f"{names[engine]}: saturated {plateau.tokens_per_second:.1f} tokens/s at micro-batch "
                      f"{plateau.micro_batch_size} x M={plateau.micro_batches}; saturates (within {100 * saturation.knee:.0f}% "
                      f"of that) at global batch {knee.global_batch} ({knee.tokens_per_second:.1f} tokens/s); "
                      f"{len(saturation.points)} configurations fit, {len(saturation.refused)} do not",
                  "| global batch | micro-batch x M | tokens/s | s/step | binds | device GiB |", "|---|---|---|---|---|---|"]
        for point in saturation.curve:
            mark = " (saturation point)" if point is knee else ""
            lines.append(f"| {point.global_batch}{mark} | {point.micro_batch_size} x {point.micro_batches} | "
                         f"{point.tokens_per_second:.1f} | {point.seconds:.3f} | {point.binding} | "
                         f"{point.device.total / GIB:.2f} |")
    lines += ["", f"ratio of the saturated throughputs, greedysnake over ZeRO-Infinity: {saturated_ratio(saturations):.2f}x"]
    if hardware.layer_times:
        from .cost_model import compute_key_fields
        sizes = sorted(int(compute_key_fields(key)["micro_batch_size"]) for key in hardware.timed_keys)
        lines.append(f"note: the probe timed the layers at micro-batch sizes {', '.join(map(str, sizes))}; other "
                     "micro-batch sizes are predicted from FLOP/s (docs/planner.md, limitations)")
    return "\n".join(lines)


def ssd_space(settings: Settings, shape, plan, ideal: bool, lora_rank: Optional[int] = None):
    """The SSD bytes per kind of the recommended block (of a LoRA run of rank ``lora_rank``: trainable
    adapters, the base frozen), and the free bytes under the config's nvme_path (None when that folder does
    not exist here)."""
    block = None if ideal else plan.greedysnake_block()
    if lora_rank is None:
        trainable, frozen = [layer.params for layer in shape.layers], None
    else:
        trainable, frozen = (list(numels) for numels in zip(*lora_numels(shape, lora_rank)))
    needed = ssd_bytes(trainable, settings, plan.micro_batches, plan.workload.checkpoint_bytes, block,
                       frozen_numels=frozen)
    nvme_path = settings.zero.nvme_path
    free = shutil.disk_usage(nvme_path).free if nvme_path and os.path.isdir(nvme_path) else None
    return needed, nvme_path, free


def _describe_ssd(needed, nvme_path, free, shape, plan, ideal: bool, lora_rank: Optional[int] = None) -> list:
    which = "this config's block" if ideal else "the recommended block"
    if lora_rank is None:
        lines = ["", f"SSD space ({which}, M = {plan.micro_batches}, one rank): {describe(needed, shape.params)}"]
    else:
        adapters = sum(trainable for trainable, _ in lora_numels(shape, lora_rank))
        base_bytes, spill = needed["frozen parameters"], needed["activation spill"]
        rest = sum(needed.values()) - base_bytes - spill
        lines = ["", f"SSD space of LoRA rank {lora_rank} ({which}, M = {plan.micro_batches}, one rank): "
                     f"{describe(needed, shape.params + adapters)}",
                 f"  the frozen base, one read-only copy: {base_bytes:,} bytes = {base_bytes / shape.params:.2f} "
                 f"bytes per base parameter; the {adapters:,} adapter parameters: {rest:,} bytes = "
                 f"{rest / adapters:.2f} bytes per adapter parameter (weights, optimizer states, gradients); "
                 f"activation spill {spill:,} bytes",
                 "  host memory: the parameter buffers hold a layer's base weights with its adapters; only the "
                 "adapters have optimizer states and gradients"]
    total = sum(needed.values())
    if free is None:
        lines.append(f"  nvme_path {nvme_path} does not exist here: free space not checked")
    else:
        verdict = "fits" if total <= free else f"does NOT fit: {total - free:,} bytes short"
        lines.append(f"  free under {nvme_path}: {free:,} bytes ({free / GIB:.2f} GiB): {verdict}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if not args.saturated and (args.micro_batch_sizes or args.ranks != 1):
            raise PlannerError("--micro-batch-sizes and --ranks apply to --saturated only: add --saturated")
        if args.zero_probe_processes < 1:
            raise PlannerError(f"--zero-probe-processes {args.zero_probe_processes}: the ZeRO-3 probe runs in at least "
                               "one process (--no-zero-probe skips it)")
        with _stdout_to_stderr_if(args.json):  # DeepSpeed's accelerator warning, when it picks one, goes to stdout
            ds_config, settings = _load_settings(args.config)
        shape = parse_layers(args.layers) if args.layers else named_shape(args.model or "gpt-small")
        with _stdout_to_stderr_if(args.json):
            hardware = _hardware(args, ds_config, settings, shape)
        request = PlanRequest(shape, hardware, None if args.host_memory is None else args.host_memory * GIB,
                              args.micro_batches, args.modelled_placements, args.ideal, not args.zero_no_recompute)
        if args.saturated:
            with _stdout_to_stderr_if(args.json):
                saturations = _sweep_saturated(args, settings, request)
            print(json.dumps(_saturated_json(shape, hardware, saturations), indent=1) if args.json
                  else _describe_saturated(shape, hardware, request, saturations))
            return 0
        with _stdout_to_stderr_if(args.json):  # DeepSpeed logs to stdout; --json output must stay clean
            plans = plan_for_settings(settings, request)
    except PlannerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    budget = budget_bytes(request)
    workload = plans[0].workload
    try:
        needed, nvme_path, free = ssd_space(settings, shape, plans[0], args.ideal, args.lora)
    except PlannerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": shape.name, "parameters": shape.params, "budget_bytes": budget,
                          "hardware": hardware.to_dict(), "recommended": dict(plans[0].to_dict(),
                          gradient_accumulation_steps=plans[0].micro_batches,
                          greedysnake_block=None if args.ideal else plans[0].greedysnake_block()),
                          "plans": [p.to_dict() for p in sorted(plans, key=lambda p: p.micro_batches)],
                          "ssd_bytes": needed, "ssd_free_bytes": free, "lora_rank": args.lora,
                          "notes": [NOT_IMPLEMENTED] if not args.modelled_placements else
                          ["modelled placements: not implemented by the engine"]}, indent=1))
    else:
        print(_describe(plans, hardware, shape, workload, budget, request))
        print("\n".join(_describe_ssd(needed, nvme_path, free, shape, plans[0], args.ideal, args.lora)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
