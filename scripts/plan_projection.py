"""The paper's experiment, projected: saturated tokens/s of greedysnake over ZeRO-Infinity on one A100.

    python scripts/plan_projection.py [--hardware configs/hardware/a100_pcie4.json] [--json]

For GPT-65B and GPT-175B (bf16, micro-batches of 1, 2 and 4 sequences of 2048 tokens) it predicts:
* greedysnake's saturated throughput: the best tokens/s over M = 1..256 of the planner's search, for
  the engine as it runs today, for the paper's ideal model (alpha split, every transfer overlapped),
  and for the ideal model with host-resident parameters / optimizer states allowed (MODELLED: the
  engine does not implement them);
* ZeRO-Infinity's saturated throughput (M large: the per-micro-batch time binds), with ZeRO-3's
  prefetch and fetch reuse on (DeepSpeed's defaults), parameters on NVMe or in host memory;
and the ratios, next to the paper's 1.96x (GPT-65B) and 2.53x (GPT-175B). Every assumption is in the
hardware file and in docs/planner.md.
"""
import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ds_greedysnake.planner import (HorizontalSettings, Workload, evaluate, horizontal_phases, load_hardware,  # noqa: E402
                                    named_shape, search)
from ds_greedysnake.planner.search import GIB  # noqa: E402

PAPER = {"gpt-65b": 1.96, "gpt-175b": 2.53}
SATURATED_M = 4096  # "M large": ZeRO-Infinity's optimizer step is amortised away
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def project(hardware, model: str, micro_batch_size: int, budget: float) -> dict:
    shape = named_shape(model)
    base = Workload(shape, micro_batch_size, 1, param_bytes=2, activation_bytes=2)
    row = {"model": model, "micro_batch_size": micro_batch_size, "paper_ratio": PAPER[model]}
    for label, engine, modelled in (("engine", True, False), ("ideal", False, False), ("ideal_modelled", False, True)):
        plans = search(base, hardware, budget, HorizontalSettings(True, True), SWEEP, engine=engine,
                       modelled_shares=modelled)
        best = max(plans, key=lambda plan: plan.prediction.tokens_per_second)
        row[f"greedysnake_{label}"] = {"tokens_per_second": best.prediction.tokens_per_second,
                                       "micro_batches": best.micro_batches, "binding": best.prediction.binding,
                                       "knee_micro_batches": plans[0].micro_batches, "shares": best.shares}
    large = Workload(shape, micro_batch_size, SATURATED_M, param_bytes=2, activation_bytes=2)
    phases = horizontal_phases(large, hardware, HorizontalSettings(prefetch=True, reuse_recompute_fetch=True))
    for label, shares in (("params_on_ssd", {}), ("params_in_host", {"param": 1.0})):
        prediction = evaluate("ZeRO-Infinity", phases, large, shares)
        row[f"zero_infinity_{label}"] = {"tokens_per_second": prediction.tokens_per_second,
                                         "binding": prediction.binding}
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default=os.path.join(REPO, "configs", "hardware", "a100_pcie4.json"))
    parser.add_argument("--host-memory", type=float, default=None, help="GiB for greedysnake's plan (default: half "
                        "the hardware's host memory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    hardware = load_hardware(args.hardware)
    budget = args.host_memory * GIB if args.host_memory else hardware.host_memory_bytes / 2
    rows = [project(hardware, model, mbs, budget) for model in PAPER for mbs in (1, 2, 4)]
    if args.json:
        print(json.dumps({"hardware": hardware.to_dict(), "budget_bytes": budget, "rows": rows}, indent=1))
        return
    print(f"hardware: {hardware.name}; greedysnake host-memory budget {budget / GIB:.0f} GiB; bf16, sequences of 2048")
    print("| model | micro-batch | ZeRO-Infinity tokens/s, params on SSD / in host (binds) | greedysnake tokens/s: "
          "engine today / ideal / ideal + host placements (modelled) | ratio over ZeRO-Infinity on SSD | "
          "ratio over ZeRO-Infinity in host | paper |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        zs, zh = row["zero_infinity_params_on_ssd"], row["zero_infinity_params_in_host"]
        g = [row[f"greedysnake_{k}"]["tokens_per_second"] for k in ("engine", "ideal", "ideal_modelled")]
        ratios = lambda base: " / ".join(f"{value / base:.2f}x" for value in g)
        print(f"| {row['model']} | {row['micro_batch_size']} | {zs['tokens_per_second']:.0f} ({zs['binding']}) / "
              f"{zh['tokens_per_second']:.0f} ({zh['binding']}) | {g[0]:.0f} / {g[1]:.0f} / {g[2]:.0f} | "
              f"{ratios(zs['tokens_per_second'])} | {ratios(zh['tokens_per_second'])} | {row['paper_ratio']}x |")


if __name__ == "__main__":
    main()
