"""SSD bytes per parameter of each configuration: computed by the engine's layout code (ssd_layout.py) for a
model shape, and with --measure, measured from the files greedysnake and ZeRO-Infinity create on disk for
a small GPT (docs/ssd_space.md's table comes from this script).

    python scripts/ssd_space.py                                  # computed, for gpt-65b
    python scripts/ssd_space.py --model gpt-small
    python scripts/ssd_space.py --measure /path/on/ssd/scratch   # + measured on the tiny GPT (about 3 min here)

Host-memory budgets are 0 (gradients and optimizer states all on SSD: the most a run needs); activations
stay in host memory (no spill).
"""
import argparse
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                   ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531")):
    os.environ.setdefault(key, value)

from ds_greedysnake.planner.shapes import GPTShape, named_shape  # noqa: E402
from ds_greedysnake.planner.ssd_space import ssd_bytes  # noqa: E402
from ds_greedysnake.settings import settings_from_ds_config  # noqa: E402

ON_SSD = {"gradient_host_memory_mb": 0, "optimizer_host_memory_mb": 0}
# (row, gradient_clipping, greedysnake block); "ALL" stands for the model's layer count.
CONFIGURATIONS = [
    ("clipping on, overlap on", 1.0, {}),
    ("clipping on, overlap off", 1.0, {"optimizer_overlap": False}),
    ("clipping off, overlap off", 0.0, {"optimizer_overlap": False}),
    ("clipping off, overlap on, deferred_layers = all", 0.0, {"deferred_layers": "ALL"}),
    ("clipping off, overlap on, deferred_layers default (a quarter)", 0.0, {}),
]
PRECISIONS = [("bf16", True, {}), ("bf16, bf16 accumulation", True, {"fp32_grad_accumulation": False}),
              ("fp32", False, {})]
TINY = dict(num_blocks=3, hidden=512, heads=4, vocab=512, seq_len=32)  # tests/helpers.py's tiny GPT, hidden 512


def ds_config(nvme_path, clipping, bf16, block, micro_batches=2):
    """The test suite's config for the tiny GPT (tests/helpers.py), ZeRO-Infinity's knobs included."""
    from helpers import ds_config as tiny_gpt_ds_config
    return tiny_gpt_ds_config(nvme_path, micro_batches, clipping=clipping, bf16=bf16, greedysnake=block)


def block_for(block, num_layers):
    return {key: (num_layers if value == "ALL" else value) for key, value in dict(ON_SSD, **block).items()}


def computed(shape: GPTShape, clipping, bf16, block) -> float:
    numels = [layer.params for layer in shape.layers]
    config = ds_config("unused", clipping, bf16, block_for(block, len(numels)))
    return sum(ssd_bytes(numels, settings_from_ds_config(config), 2, 0).values()) / shape.params


def measured_greedysnake(folder, clipping, bf16, block) -> float:
    from greedysnake_run import make_engine
    shape = GPTShape("tiny", **TINY)
    engine, _ = make_engine(folder, 2, hidden=TINY["hidden"], clipping=clipping, bf16=bf16,
                            greedysnake=block_for(block, len(shape.layers)))
    files = sum(os.path.getsize(os.path.join(engine.swap_folder, name)) for name in os.listdir(engine.swap_folder)
                if name.endswith(".bin"))
    engine.close()
    shutil.rmtree(folder, ignore_errors=True)
    return files / shape.params


def measured_zero_infinity(folder, bf16):
    """Bytes per parameter of ZeRO-Infinity's swap files after initialize and after its first step."""
    import deepspeed
    import torch
    import ds_greedysnake
    from ds_greedysnake.models.gpt import build_gpt, lm_loss
    from helpers import data, tiny_gpt_config

    os.makedirs(folder, exist_ok=True)
    config = tiny_gpt_config(TINY["hidden"])
    ds = ds_config(folder, 1.0, bf16, {"enabled": False})
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = build_gpt(config)
    engine, _, _, _ = ds_greedysnake.initialize(model=model, model_parameters=model.parameters(), config=ds,
                                                loss_fn=lm_loss)
    params = GPTShape("tiny", **TINY).params
    after_initialize = _folder_bytes(folder) / params
    engine.train_batch(data(config))
    after_step = _folder_bytes(folder) / params
    shutil.rmtree(folder, ignore_errors=True)
    return after_initialize, after_step


def _folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-65b", help="a named shape (python -m ds_greedysnake.plan --help)")
    parser.add_argument("--measure", default=None, help="a scratch folder on the SSD: also measure the tiny GPT")
    parser.add_argument("--measure-only", default=None, choices=[name for name, _, _ in PRECISIONS],
                        help="measure this precision's column only (the others are computed)")
    args = parser.parse_args()
    shape = named_shape(args.model)
    tiny = GPTShape("tiny", **TINY)
    heading = [name for name, _, _ in PRECISIONS]
    print(f"SSD bytes per parameter, computed for {shape.name} ({shape.params / 1e9:.2f} B parameters, "
          f"{len(shape.layers)} layers)" + (f"; measured from the files for the tiny GPT ({tiny.params:,} "
                                             "parameters, 5 layers) in brackets" if args.measure else ""))
    print("\n| configuration | " + " | ".join(heading) + " |")
    print("|---|" + "---|" * len(heading))
    for row, clipping, block in CONFIGURATIONS:
        cells = []
        for name, bf16, extra in PRECISIONS:
            merged = dict(block, **extra)
            cell = f"{computed(shape, clipping, bf16, merged):.2f}"
            if args.measure and args.measure_only in (None, name):
                folder = os.path.join(args.measure, "gs")
                cell += f" ({measured_greedysnake(folder, clipping, bf16, merged):.2f}; "
                cell += f"computed {computed(tiny, clipping, bf16, merged):.2f})"
            cells.append(cell)
        print(f"| {row} | " + " | ".join(cells) + " |")
    if args.measure:
        for name, bf16 in (("bf16", True), ("fp32", False)):
            if args.measure_only not in (None, name):
                continue
            after_initialize, after_step = measured_zero_infinity(os.path.join(args.measure, "zi"), bf16)
            print(f"\nZeRO-Infinity, {name}, clipping on, tiny GPT: {after_initialize:.2f} bytes per parameter after "
                  f"initialize, {after_step:.2f} after its first step (it creates its gradient files then)")


if __name__ == "__main__":
    main()
