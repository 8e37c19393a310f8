"""The SSD space a scripts/train_hf.py run needs, before running it: greedysnake's bytes per kind (the layout
initialize will allocate, ssd_layout.py, for the model built on the meta device), ZeRO-Infinity's by
DeepSpeed's swap rules, and the free space under --nvme-path. Takes train_hf.py's arguments:

    python scripts/hf_ssd_need.py --family llama --hidden 2560 --layers 33 --heads 20 --vocab 32000 \
        --seq-len 128 --micro-batches 4 --nvme-path /path/on/ssd
"""
import json
import os
import shutil
import sys

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SCRIPTS)

from train_hf import build_config, model_config, parse_args  # noqa: E402  (sets RANK etc. too)

import torch  # noqa: E402

from ds_greedysnake.planner.ssd_space import model_ssd_bytes, zero_infinity_ssd_bytes  # noqa: E402
from ds_greedysnake.settings import settings_from_ds_config  # noqa: E402
from ds_greedysnake.storage.ssd_layout import describe  # noqa: E402


def main():
    args = parse_args()
    config = build_config(args)
    if args.fp32:
        config.pop("bf16", None)
    if args.bf16:
        config["bf16"] = {"enabled": True}
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(args))
    params = sum(p.numel() for p in model.parameters())
    bf16 = bool(config.get("bf16", {}).get("enabled"))
    hidden = model.config.hidden_size
    checkpoint_bytes = config["train_micro_batch_size_per_gpu"] * args.seq_len * hidden * (2 if bf16 else 4)
    greedysnake = model_ssd_bytes(model, settings_from_ds_config(config), config["gradient_accumulation_steps"],
                                  checkpoint_bytes)
    zero = zero_infinity_ssd_bytes([p.numel() for p in model.parameters()], bf16,
                                   int(config["zero_optimization"].get("sub_group_size", 10**9)),
                                   int((config.get("aio") or {}).get("block_size", 2**20)))
    nvme_path = config["zero_optimization"]["offload_param"]["nvme_path"]
    free = shutil.disk_usage(nvme_path).free
    report = {"parameters": params, "greedysnake_bytes": greedysnake, "zero_infinity_bytes": zero,
              "free_bytes": free, "nvme_path": nvme_path}
    print(f"{type(model).__name__}: {params:,} parameters, {'bf16' if bf16 else 'fp32'}")
    for name, need in (("greedysnake", greedysnake), ("ZeRO-Infinity", zero)):
        total = sum(need.values())
        verdict = "fits" if total <= free else f"does NOT fit ({total - free:,} bytes short)"
        print(f"{name}: {describe(need, params)}: {verdict}")
    print(f"free under {nvme_path}: {free:,} bytes ({free / 2**30:.2f} GiB)")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
