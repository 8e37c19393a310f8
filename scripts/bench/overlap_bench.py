"""Step time with the optimizer overlap off and on, in one run, on the same model and data.

    python scripts/bench/overlap_bench.py                 # about 3 minutes on 2 cores
    python scripts/bench/overlap_bench.py --train-threads 1    # leave a core to the optimizer worker

Prints a markdown table: median step time over the measured steps (after warm-up), the optimizer
time per step (Adam updates with their SSD reads and writes), the share of it hidden behind
training, and tokens/s. "on, clip 1.0" is the overlap with gradient clipping, where every update is
deferred into the next forward (exactness: the clip coefficient needs every gradient first).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29521")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402

import ds_greedysnake  # noqa: E402
from ds_greedysnake.models.gpt import GPTConfig, build_gpt, lm_loss, micro_batches, synthetic_corpus  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nvme-path", default=os.path.join(REPO, ".nvme_swap"))
    parser.add_argument("--train-threads", type=int, default=None,
                        help="torch threads of the training process (default: torch's, all cores); the optimizer "
                             "worker has optimizer_worker_threads (1)")
    parser.add_argument("--json", default=None, help="also write the measurements to this file")
    return parser.parse_args()


def ds_config(args, nvme_path: str, overlap: bool, clipping: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.micro_batches,
        "gradient_clipping": clipping,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}},
        "greedysnake": {"enabled": True, "optimizer_overlap": overlap},
    }


def measure(args, label: str, overlap: bool, clipping: float) -> dict:
    nvme_path = tempfile.mkdtemp(prefix="overlap_bench_", dir=args.nvme_path)
    gpt = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, hidden=args.hidden, num_heads=8,
                    num_layers=args.layers)
    torch.manual_seed(0)
    engine, _, _, _ = ds_greedysnake.initialize(model=build_gpt(gpt), config=ds_config(args, nvme_path, overlap, clipping),
                                                loss_fn=lm_loss)
    batches = micro_batches(synthetic_corpus(100_000, args.vocab), args.micro_batch_size, args.seq_len)
    metrics, losses = [], []
    for step in range(args.warmup + args.steps):
        losses.append(float(engine.train_batch(batches)))
        if step >= args.warmup:
            metrics.append(engine.last_step_metrics)
    engine.close()
    optimizer = sum(m.optimizer_seconds for m in metrics)
    waited = sum(m.optimizer_wait_seconds for m in metrics)
    median = statistics.median(m.seconds for m in metrics)
    return {"label": label, "median_step_s": median, "optimizer_s_per_step": optimizer / len(metrics),
            "hidden_share": max(0.0, 1 - waited / optimizer) if optimizer > 0 else float("nan"),
            "compute_s_per_step": sum(m.compute_seconds for m in metrics) / len(metrics),
            "tokens_per_s": metrics[0].tokens / median, "final_loss": losses[-1],
            "parameters": sum(layer.numel for layer in engine.layers)}


def main():
    args = parse_args()
    if args.train_threads:
        torch.set_num_threads(args.train_threads)
    os.makedirs(args.nvme_path, exist_ok=True)
    results = [measure(args, "off", False, 0.0), measure(args, "on", True, 0.0),
               measure(args, "on, clip 1.0", True, 1.0)]
    baseline = results[0]["median_step_s"]
    print(f"\n{results[0]['parameters'] / 1e6:.1f}M parameters, {args.layers} blocks, hidden {args.hidden}, "
          f"M={args.micro_batches} x {args.micro_batch_size} x {args.seq_len} tokens, "
          f"{args.steps} measured steps after {args.warmup} warm-up, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} training threads")
    print("| overlap | median step s | speed-up | optimizer s / step | hidden share | compute s / step | tokens/s | final loss |")
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        print(f"| {result['label']} | {result['median_step_s']:.2f} | {baseline / result['median_step_s']:.2f}x | "
              f"{result['optimizer_s_per_step']:.2f} | {100 * result['hidden_share']:.0f}% | "
              f"{result['compute_s_per_step']:.2f} | {result['tokens_per_s']:.0f} | {result['final_loss']:.4f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
