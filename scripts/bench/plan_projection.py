"""The paper's experiment, projected the way the paper measures it: saturated tokens/s of greedysnake
over ZeRO-Infinity, each engine at the batch configuration where its throughput stops growing.

    python scripts/bench/plan_projection.py                       # the table, the assumptions, docs/plan_projection.png
    python scripts/bench/plan_projection.py --sensitivity         # and the ratio's sensitivity to each rate (a few minutes)
    python scripts/bench/plan_projection.py --explain --no-plot   # the factor each assumption alone would need for the paper's ratio
    python scripts/bench/plan_projection.py --hardware FILE --json --no-plot

Three settings (arXiv 2512.17570's headline, as the design notes restate it): GPT-65B on one A100
(1.96x), on four A100s with data parallelism (1.93x), GPT-175B on one A100 (2.53x). For each, every
micro-batch size and M that fit the device's memory is predicted (``ds_greedysnake.planner.saturation``):
greedysnake as the engine runs and as the paper's ideal model; ZeRO-Infinity with DeepSpeed's ZeRO-3
defaults (prefetch and fetch reuse on) and as DeepSpeed 0.19.8 runs with NVMe parameters here
(prefetch and reuse off: docs/zero_infinity.md). Every assumption is a field of the hardware file with
its source (paper, vendor sheet or assumed); the script prints them.
"""
import argparse
import dataclasses
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from ds_greedysnake.planner import HorizontalSettings, load_hardware, named_shape  # noqa: E402
from ds_greedysnake.planner.saturation import SweepRequest, sweep  # noqa: E402
from ds_greedysnake.planner.search import GIB  # noqa: E402

# (label, model, GPUs, the paper's saturated ratio)
SETTINGS = (("GPT-65B, 1 A100", "gpt-65b", 1, 1.96), ("GPT-65B, 4 A100s (data parallel)", "gpt-65b", 4, 1.93),
            ("GPT-175B, 1 A100", "gpt-175b", 1, 2.53))
ZERO_VARIANTS = {
    "defaults": HorizontalSettings(prefetch=True, reuse_recompute_fetch=True),
    # What DeepSpeed 0.19.8 needs to run with parameters on NVMe (docs/zero_infinity.md), as ab_bench runs it.
    "as_run_here": HorizontalSettings(prefetch=False, reuse_recompute_fetch=False, prefetch_bucket_elements=0),
}
TOLERANCE = 0.15
# The sensitivity table: each assumption moved alone, by these factors.
FACTORS = (0.5, 2.0)
SENSITIVITY = {
    "SSD read/write rate": ("ssd_read_bytes_per_s", "ssd_read_bytes_per_s_single", "ssd_write_bytes_per_s",
                            "ssd_write_bytes_per_s_single"),
    "host link": ("host_device_bytes_per_s",),
    "CPU Adam rate": ("adam_elements_per_s",),
    "GPU FLOP/s": ("device_flops_per_s",),
    "device memory": ("device_memory_bytes",),
    # ZeRO-3's swapper issues one op per tensor: its rate alone (serial fetches without prefetch, the optimizer step).
    "ZeRO-3's one-op SSD rates": ("ssd_read_bytes_per_s_single", "ssd_write_bytes_per_s_single"),
}


def project(hardware, model: str, ranks: int, budget: float, with_ideal: bool = True, splits=None) -> dict:
    """Saturations of greedysnake (engine, and the ideal model unless ``with_ideal`` is false) and of
    ZeRO-Infinity (both variants) for one setting. ``splits``: greedysnake's (None: the sweep's own)."""
    shape = named_shape(model)
    found = {}
    for label, ideal in (("engine", False), ("ideal", True))[:2 if with_ideal else 1]:
        request = SweepRequest(shape, hardware, budget, ranks=ranks, ideal=ideal, engines=("greedysnake",),
                               splits=None if ideal else splits)
        found[f"greedysnake_{label}"] = sweep(request)["greedysnake"]
    for label, settings in ZERO_VARIANTS.items():
        request = SweepRequest(shape, hardware, budget, zero_settings=settings, ranks=ranks, engines=("zero_infinity",))
        found[f"zero_infinity_{label}"] = sweep(request)["zero_infinity"]
    return found


def ratios(found: dict) -> dict:
    """Ratios of the plateaus (the paper's measure); and, a different quantity, of the best tokens/s at
    up to greedysnake's (engine) saturation point's global batch."""
    rate = {key: saturation.plateau.tokens_per_second for key, saturation in found.items()}
    result = {f"{gs}_over_{zi}": rate[f"greedysnake_{gs}"] / rate[f"zero_infinity_{zi}"]
              for gs in ("engine", "ideal") if f"greedysnake_{gs}" in rate for zi in ZERO_VARIANTS}
    knee = found["greedysnake_engine"].saturation_point
    for zi in ZERO_VARIANTS:
        result[f"engine_over_{zi}_at_engine_saturation"] = knee.tokens_per_second / best_up_to(
            found[f"zero_infinity_{zi}"], knee.global_batch)
    return result


def best_up_to(saturation, global_batch: int) -> float:
    return max(p.tokens_per_second for p in saturation.curve if p.global_batch <= global_batch)


def scaled(hardware, names, factor):
    return dataclasses.replace(hardware, **{name: getattr(hardware, name) * factor for name in names
                                            if getattr(hardware, name) is not None})


def describe(saturation) -> str:
    plateau, knee = saturation.plateau, saturation.saturation_point
    return (f"{plateau.tokens_per_second:.0f} (saturates at global batch {knee.global_batch}; best at "
            f"{plateau.micro_batch_size} x {plateau.micro_batches}, {plateau.binding})")


def print_table(rows) -> None:
    print("| setting | greedysnake tokens/s, engine (global batch at saturation; best micro-batch x M, binds) | "
          "ideal | ZeRO-Infinity tokens/s, DeepSpeed defaults | as run here (no prefetch, no reuse) | "
          "ratio engine / ZI defaults | engine / ZI as run | ideal / ZI defaults | ideal / ZI as run | paper |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, paper, found, ratio in rows:
        print(f"| {label} | {describe(found['greedysnake_engine'])} | {found['greedysnake_ideal'].plateau.tokens_per_second:.0f} | "
              f"{describe(found['zero_infinity_defaults'])} | {describe(found['zero_infinity_as_run_here'])} | "
              + " | ".join(f"{ratio[key]:.2f}x" for key in ("engine_over_defaults", "engine_over_as_run_here",
                                                             "ideal_over_defaults", "ideal_over_as_run_here"))
              + f" | {paper:.2f}x |")


def print_assumptions(hardware) -> None:
    print("\nassumptions (configs/hardware file, with their sources):")
    for key, entry in hardware.assumptions.items():
        value = entry.get("value", getattr(hardware, key, ""))
        print(f"- {key} = {value} [{entry['source']}]: {entry['note']}")


def default_split_ratios(hardware, budget, model: str, ranks: int) -> dict:
    """``ratios`` of one setting with greedysnake's engine at its default split only (no ideal model)."""
    from ds_greedysnake.runtime.schedule import default_deferred_layers
    split = default_deferred_layers(len(named_shape(model).layers))
    return ratios(project(hardware, model, ranks, budget, with_ideal=False, splits=[split]))


def sensitivity(hardware, budget) -> list:
    """Per assumption and factor, the engine's ratio over both ZeRO-Infinity variants, per setting; the
    engine's default split only (the plateau moved by under 1.3% against four splits here), to keep
    the 30 sweeps within minutes."""
    table = []
    for name, fields in [("(as assumed)", ())] + list(SENSITIVITY.items()):
        for factor in (FACTORS if fields else (1.0,)):
            moved = scaled(hardware, fields, factor)
            entry = {"assumption": name, "factor": factor,
                     "ratios": {label: default_split_ratios(moved, budget, model, ranks)
                                for label, model, ranks, _ in SETTINGS}}
            table.append(entry)
            print(f"  sensitivity: {name} x{factor} done", file=sys.stderr, flush=True)
    return table


# --explain: how far each assumption would have to move, alone, for the projected ratio to be the paper's.
EXPLAIN_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)
EXPLAIN_BISECTIONS = 3


def engine_ratios_at(hardware, budget, fields, factor, model: str, ranks: int) -> dict:
    """The engine's saturated ratio over each ZeRO-Infinity variant with ``fields`` scaled by ``factor``
    (the engine's default split only, as the sensitivity table)."""
    from ds_greedysnake.planner.errors import PlannerError
    try:
        found = default_split_ratios(scaled(hardware, fields, factor), budget, model, ranks)
    except PlannerError:  # an engine fits no configuration there (device memory too small): no ratio
        return {variant: None for variant in ZERO_VARIANTS}
    return {variant: found[f"engine_over_{variant}"] for variant in ZERO_VARIANTS}


def break_even(evaluate, grid: dict, paper: float, variant: str):
    """The factor nearest to x1 (on a log scale) at which the ratio over ``variant`` crosses the paper's,
    refined by bisection between the grid points that bracket it; None when no factor of the grid reaches it
    (a factor at which an engine fits nothing has no ratio and brackets nothing)."""
    factors = sorted(grid)
    one = factors.index(1.0)
    brackets = []
    for step in (-1, 1):   # outward from x1, each way
        index = one
        while 0 <= index + step < len(factors):
            a, b = factors[index], factors[index + step]
            if grid[b][variant] is None:
                break
            if (grid[a][variant] - paper) * (grid[b][variant] - paper) <= 0:
                brackets.append((a, b))
                break
            index += step
    if not brackets:
        return None
    a, b = min(brackets, key=lambda pair: abs(math.log(pair[1])))
    ra = grid[a][variant]
    for _ in range(EXPLAIN_BISECTIONS):
        middle = math.sqrt(a * b)
        rm = evaluate(middle)[variant]
        if rm is None:
            break
        if (ra - paper) * (rm - paper) <= 0:
            b = middle
        else:
            a, ra = middle, rm
    return math.sqrt(a * b)


def explain(hardware, budget) -> list:
    """Per setting and assumption: the ratios over the grid of factors and the break-even factor for each
    ZeRO-Infinity variant."""
    table = []
    for label, model, ranks, paper in SETTINGS:
        unmoved = engine_ratios_at(hardware, budget, (), 1.0, model, ranks)
        for name, fields in SENSITIVITY.items():
            evaluate = lambda factor: engine_ratios_at(hardware, budget, fields, factor, model, ranks)  # noqa: E731
            grid = {factor: unmoved if factor == 1.0 else evaluate(factor) for factor in EXPLAIN_GRID}
            table.append({"setting": label, "paper": paper, "assumption": name,
                          "grid": {f"{factor:g}": value for factor, value in grid.items()},
                          "break_even": {variant: break_even(evaluate, grid, paper, variant) for variant in ZERO_VARIANTS}})
            print(f"  explain: {label}, {name} done", file=sys.stderr, flush=True)
    return table


def print_explain(table: list) -> None:
    print("\nwhat would explain the paper's ratio: the factor one assumption alone would have to be off by for the "
          "projected ratio (the engine over ZeRO-Infinity, DeepSpeed defaults / as run here) to equal the paper's; "
          f"'-' where no factor in x{EXPLAIN_GRID[0]:g}..x{EXPLAIN_GRID[-1]:g} reaches it; then the ratios over that "
          "grid (as run here)")
    print("| setting | assumption | break-even factor, defaults | break-even factor, as run here | ratio over as run "
          "here at " + ", ".join(f"x{factor:g}" for factor in EXPLAIN_GRID) + " |")
    print("|---|---|---|---|---|")
    for entry in table:
        factors = [entry["break_even"][variant] for variant in ZERO_VARIANTS]
        print(f"| {entry['setting']} (paper {entry['paper']:.2f}x) | {entry['assumption']} | "
              + " | ".join("-" if factor is None else f"x{factor:.2f}" for factor in factors) + " | "
              + ", ".join(ratio_text(entry["grid"][f"{factor:g}"]["as_run_here"]) for factor in EXPLAIN_GRID) + " |")


def ratio_text(ratio) -> str:
    return "fits nothing" if ratio is None else f"{ratio:.2f}"


def print_sensitivity(table: list) -> None:
    print("\nsensitivity: greedysnake engine's saturated ratio over ZeRO-Infinity (DeepSpeed defaults / as run here)"
          " when one assumption moves (the engine's default split only)")
    print("| assumption | factor | " + " | ".join(label for label, _, _, _ in SETTINGS) + " |")
    print("|---|---|" + "---|" * len(SETTINGS))
    for entry in table:
        print(f"| {entry['assumption']} | x{entry['factor']:g} | " + " | ".join(
            f"{entry['ratios'][label]['engine_over_defaults']:.2f}x / {entry['ratios'][label]['engine_over_as_run_here']:.2f}x"
            for label, _, _, _ in SETTINGS) + " |")


def plot(rows, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, len(rows), figsize=(5.2 * len(rows), 4.2))
    styles = {"greedysnake_engine": ("greedysnake (engine)", "tab:green", "-"),
              "greedysnake_ideal": ("greedysnake (ideal model)", "tab:green", ":"),
              "zero_infinity_defaults": ("ZeRO-Infinity (DeepSpeed defaults)", "tab:red", "-"),
              "zero_infinity_as_run_here": ("ZeRO-Infinity (no prefetch, no reuse)", "tab:red", "--")}
    for axis, (label, paper, found, ratio) in zip(axes, rows):
        for key, (name, colour, line) in styles.items():
            curve = found[key].curve
            axis.plot([p.global_batch for p in curve], [p.tokens_per_second for p in curve], line, color=colour,
                      label=name, marker="." if line == "-" else None)
            knee = found[key].saturation_point
            axis.plot([knee.global_batch], [knee.tokens_per_second], "o", color=colour, fillstyle="none", markersize=9)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("global batch (sequences of 2048 tokens)")
        axis.set_ylabel("tokens/s (predicted)")
        axis.set_title(f"{label}\nratio {ratio['engine_over_defaults']:.2f}x / {ratio['engine_over_as_run_here']:.2f}x "
                       f"(paper {paper:.2f}x)", fontsize=10)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    figure.suptitle("Projected tokens/s against global batch (configs/hardware/a100_pcie4.json; circles: saturation "
                    "points, 95% of the best)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default=os.path.join(REPO, "configs", "hardware", "a100_pcie4.json"))
    parser.add_argument("--host-memory", type=float, default=None, help="GiB for greedysnake's plans, shared by the "
                        "ranks (default: half the hardware's host memory)")
    parser.add_argument("--sensitivity", action="store_true", help="also move each assumption by x0.5 and x2")
    parser.add_argument("--explain", action="store_true",
                        help="per setting and assumption, the factor that alone would give the paper's ratio")
    parser.add_argument("--plot", default=os.path.join(REPO, "docs", "plan_projection.png"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    hardware = load_hardware(args.hardware)
    budget = args.host_memory * GIB if args.host_memory else hardware.host_memory_bytes / 2
    rows = []
    for label, model, ranks, paper in SETTINGS:
        found = project(hardware, model, ranks, budget)
        rows.append((label, paper, found, ratios(found)))
    table = sensitivity(hardware, budget) if args.sensitivity else None
    explained = explain(hardware, budget) if args.explain else None
    if args.json:
        print(json.dumps({"hardware": hardware.to_dict(), "budget_bytes": budget, "settings": [
            {"setting": label, "paper_ratio": paper, "ratios": ratio,
             "saturations": {key: saturation.to_dict() for key, saturation in found.items()}}
            for label, paper, found, ratio in rows], "sensitivity": table, "explain": explained}, indent=1))
    else:
        print(f"hardware: {hardware.name}; greedysnake host-memory budget {budget / GIB:.0f} GiB (shared by the ranks); "
              "bf16, sequences of 2048; saturated = the best tokens/s over every micro-batch size and M that fit")
        print_table(rows)
        for label, paper, found, ratio in rows:
            for variant in ZERO_VARIANTS:
                value = ratio[f"engine_over_{variant}"]
                close = abs(value / paper - 1) <= TOLERANCE
                print(f"{label}: engine over ZeRO-Infinity ({variant.replace('_', ' ')}) {value:.2f}x against the "
                      f"paper's {paper:.2f}x: {'within' if close else 'NOT within'} {100 * TOLERANCE:.0f}%; at "
                      f"greedysnake's saturation point (global batch "
                      f"{found['greedysnake_engine'].saturation_point.global_batch}) "
                      f"{ratio[f'engine_over_{variant}_at_engine_saturation']:.2f}x")
        print_assumptions(hardware)
        if table is not None:
            print_sensitivity(table)
        if explained is not None:
            print_explain(explained)
    if not args.no_plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
