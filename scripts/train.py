"""Train the built-in small GPT on a generated corpus with greedysnake (or ZeRO-Infinity with --baseline).

    python scripts/train.py                      # one process, defaults from configs/greedysnake_gpt_small.json
    deepspeed --num_gpus 1 scripts/train.py ...  # through DeepSpeed's launcher
    DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --num_gpus 2 scripts/train.py   # two ranks on the CPU

Prints per step: loss, tokens/s and the bytes read from and written to SSD (counted at the aio layer
for greedysnake; from the process's I/O counters for both engines).
"""
import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Without the launcher, be a one-process job (DeepSpeed would otherwise look for MPI).
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29517")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402
import deepspeed  # noqa: E402

import ds_greedysnake  # noqa: E402
from ds_greedysnake.models.gpt import GPTConfig, build_gpt, lm_loss, micro_batches, synthetic_corpus  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "greedysnake_gpt_small.json"))
    parser.add_argument("--nvme-path", default=None, help="folder on an SSD (default: the config's, under the repo)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=None, help="gradient_accumulation_steps (M)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--baseline", action="store_true", help="DeepSpeed's ZeRO-Infinity instead of greedysnake")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser.parse_args()


def use_nvme_path(config: dict, nvme_path) -> str:
    """Point both offloads of ``config`` at ``nvme_path`` (default: the config's own; relative to the repo),
    created; returns it."""
    nvme_path = nvme_path or config["zero_optimization"]["offload_param"]["nvme_path"]
    if not os.path.isabs(nvme_path):
        nvme_path = os.path.join(REPO, nvme_path)
    os.makedirs(nvme_path, exist_ok=True)
    for section in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][section]["nvme_path"] = nvme_path
    return nvme_path


def build_config(args) -> dict:
    with open(args.config) as handle:
        config = json.load(handle)
    use_nvme_path(config, args.nvme_path)
    if args.micro_batches:
        config["gradient_accumulation_steps"] = args.micro_batches
    if args.bf16:
        config["bf16"] = {"enabled": True}
    config.setdefault("greedysnake", {})["enabled"] = not args.baseline
    return config


def process_io_bytes():
    try:
        with open("/proc/self/io") as handle:
            fields = dict(line.split(": ") for line in handle.read().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except OSError:
        return 0, 0


def main():
    args = parse_args()
    config = build_config(args)
    gpt = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, hidden=args.hidden, num_heads=args.heads,
                    num_layers=args.layers)
    torch.manual_seed(args.seed)
    if args.baseline:
        # ZeRO-3 needs the model built under zero.Init (else fp32 configs get bf16 weights on CPU).
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_gpt(gpt)
    else:
        model = build_gpt(gpt)
    parameters = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    engine, _, _, _ = ds_greedysnake.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                loss_fn=lm_loss)
    engine_name = "ZeRO-Infinity" if args.baseline else "greedysnake"
    if int(os.environ["RANK"]) == 0:
        print(f"{engine_name}: {parameters / 1e6:.1f}M parameters, {len(list(model.children()))} layers, "
              f"M={config['gradient_accumulation_steps']} micro-batches of {config['train_micro_batch_size_per_gpu']}"
              f" x {args.seq_len} tokens per rank, {os.environ['WORLD_SIZE']} rank(s), SSD folder "
              f"{config['zero_optimization']['offload_param']['nvme_path']}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stream = micro_batches(synthetic_corpus(200_000, args.vocab, args.seed), config["train_micro_batch_size_per_gpu"],
                           args.seq_len, args.seed)
    batches = distributed_micro_batches(stream, rank, world_size)
    tokens_per_step = (world_size * config["gradient_accumulation_steps"] * config["train_micro_batch_size_per_gpu"]
                       * args.seq_len)
    for step in range(1, args.steps + 1):
        io_before = process_io_bytes()
        started = time.perf_counter()
        loss = float(engine.train_batch(batches))
        seconds = time.perf_counter() - started
        io_after = process_io_bytes()
        line = (f"step {step:3d}  loss {loss:.4f}  tokens/s {tokens_per_step / seconds:8.0f}  "
                f"step {seconds:6.2f}s  process I/O read {(io_after[0] - io_before[0]) / 2**20:7.1f} MiB "
                f"written {(io_after[1] - io_before[1]) / 2**20:7.1f} MiB")
        metrics = getattr(engine, "last_step_metrics", None)
        if metrics is not None:
            line += (f"  | aio read {sum(metrics.ssd_bytes_read.values()) / 2**20:7.1f} MiB "
                     f"(params {metrics.ssd_bytes_read.get('param', 0) / 2**20:.1f}) "
                     f"written {sum(metrics.ssd_bytes_written.values()) / 2**20:7.1f} MiB")
        if rank == 0:
            print(line, flush=True)


def distributed_micro_batches(stream, rank: int, world_size: int):
    """A distributed sampler over one shared stream: rank r takes micro-batches r, r+W, r+2W, ..."""
    while True:
        group = [next(stream) for _ in range(world_size)]
        yield group[rank]


if __name__ == "__main__":
    main()
