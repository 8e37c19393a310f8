"""What ``zero_to_fp32`` gives on a checkpoint whose optimizer states were on NVMe, for both engines.

    python scripts/bench/zero_to_fp32_compare.py [--work DIR] [--layers 2 --hidden 256]

Trains the built-in GPT two steps with the config's NVMe offload of parameters and optimizer states
(configs/greedysnake_gpt_small.json), once on DeepSpeed's ZeRO-Infinity (the block off) and once on
greedysnake; each engine's ``save_checkpoint``; then the recovery script in the checkpoint folder, run as
a user runs it (``python <dir>/zero_to_fp32.py <dir> <out> --safe_serialization``), and DeepSpeed's own
``python -m deepspeed.utils.zero_to_fp32`` on the same folder. Prints, per engine and tool, what it did:
its exit code and last error line, or the tensors it wrote and their largest relative L2 difference
from the engine's own fp32 weights (ZeRO-Infinity's gathered fp32 partitions, greedysnake's masters).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29521")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402
import deepspeed  # noqa: E402

import ds_greedysnake  # noqa: E402
from ds_greedysnake.models.gpt import GPTConfig, build_gpt, lm_loss, micro_batches, synthetic_corpus  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=os.path.join(REPO, ".cache", "zero_to_fp32_compare"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    return parser.parse_args()


def config_for(work: str, greedysnake: bool) -> dict:
    with open(os.path.join(REPO, "configs", "greedysnake_gpt_small.json")) as handle:
        config = json.load(handle)
    nvme = os.path.join(work, "nvme_greedysnake" if greedysnake else "nvme_zero_infinity")
    os.makedirs(nvme, exist_ok=True)
    for section in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][section]["nvme_path"] = nvme
    config["gradient_accumulation_steps"] = 2
    config["greedysnake"]["enabled"] = greedysnake
    return config


def train_and_save(work: str, gpt: GPTConfig, greedysnake: bool):
    """Two steps, then save_checkpoint; the checkpoint folder and the engine's fp32 weights by name."""
    config = config_for(work, greedysnake)
    torch.manual_seed(0)
    if greedysnake:
        model = build_gpt(gpt)
    else:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_gpt(gpt)
    engine, _, _, _ = ds_greedysnake.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                loss_fn=lm_loss)
    batches = micro_batches(synthetic_corpus(20_000, gpt.vocab_size), config["train_micro_batch_size_per_gpu"],
                            gpt.seq_len)
    for _ in range(2):
        engine.train_batch(batches)
    folder = os.path.join(work, "checkpoint_" + ("greedysnake" if greedysnake else "zero_infinity"))
    engine.save_checkpoint(folder)
    if greedysnake:
        truth = engine.master_parameters()
        engine.close()
    else:
        truth = {}
        for name, param in engine.module.named_parameters():
            # An fp32 run: the gathered parameter is the fp32 weight the optimizer holds.
            with deepspeed.zero.GatheredParameters([param]):
                truth[name] = param.detach().float().clone()
    return folder, truth


def run_tool(command, out_dir: str, truth) -> str:
    shutil.rmtree(out_dir, ignore_errors=True)
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
        return f"exit {done.returncode}: {lines[-1] if lines else '(no output)'}"
    from safetensors.torch import load_file
    listing = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    files = [name for name in listing if name.endswith(".safetensors")]
    if not files:
        return f"exit 0, but no safetensors file in {out_dir} (it holds {listing})"
    weights = {}
    for name in files:
        weights.update(load_file(os.path.join(out_dir, name)))
    empty = sorted(name for name, value in weights.items() if value.numel() == 0)
    common = [name for name in truth if name in weights and weights[name].numel() == truth[name].numel()]
    worst = max((float((weights[name].float().reshape(truth[name].shape) - truth[name]).norm() /
                       truth[name].norm().clamp_min(1e-30)) for name in common), default=float("nan"))
    return (f"exit 0, {len(weights)} tensors ({len(empty)} empty), {len(common)} of {len(truth)} parameters with "
            f"their full size; largest relative L2 difference from the engine's fp32 weights {worst:.2e}")


def main():
    args = parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    gpt = GPTConfig(vocab_size=2048, seq_len=64, hidden=args.hidden, num_heads=4, num_layers=args.layers)
    for greedysnake in (False, True):
        engine = "greedysnake" if greedysnake else "ZeRO-Infinity"
        folder, truth = train_and_save(args.work, gpt, greedysnake)
        print(f"{engine}: checkpoint {folder}: {sorted(os.listdir(folder))}", flush=True)
        tools = {"the folder's zero_to_fp32.py": [sys.executable, os.path.join(folder, "zero_to_fp32.py")],
                 "python -m deepspeed.utils.zero_to_fp32": [sys.executable, "-m", "deepspeed.utils.zero_to_fp32"]}
        for label, tool in tools.items():
            out_dir = os.path.join(args.work, "out")
            result = run_tool(tool + [folder, out_dir, "--safe_serialization"], out_dir, truth)
            print(f"  {label}: {result}", flush=True)


if __name__ == "__main__":
    main()
