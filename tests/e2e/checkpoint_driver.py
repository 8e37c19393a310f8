"""A training process for the checkpoint tests: each call is a fresh process, as a resumed job is.

    python checkpoint_driver.py straight --steps 4 ...          # uninterrupted reference
    python checkpoint_driver.py save --steps 2 ...               # train, save, exit
    python checkpoint_driver.py save --steps 2 --kill-at state   # ... then train 1 more and die saving
    python checkpoint_driver.py resume --steps 2 ...             # load 'latest', train on

Writes losses, step counts and every layer's fp32 master weights to --out (torch.save).
"""
import argparse
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402

import ds_greedysnake.storage.checkpoint as checkpoint_module  # noqa: E402
from greedysnake_run import make_engine  # noqa: E402

NUM_MICRO_BATCHES = 2
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 3}}


def arm_kill(point: str) -> None:
    """SIGKILL this process at ``point`` of the next save: 'layer:<i>' after layer i's file, 'state'
    after the state file (before publishing), 'published' after the rename (before 'latest' moves)."""
    original_save = checkpoint_module._save_durably

    def save_then_maybe_die(obj, path):
        original_save(obj, path)
        name = os.path.basename(path)
        if (point.startswith("layer:") and name.startswith(f"layer_{point.split(':')[1]}.")) or \
                (point == "state" and name.startswith("state.")):
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_module._save_durably = save_then_maybe_die
    if point == "published":
        original_replace = os.replace

        def replace_or_die(source, destination):
            if os.path.basename(destination) == checkpoint_module.LATEST:
                os.kill(os.getpid(), signal.SIGKILL)
            return original_replace(source, destination)

        checkpoint_module.os.replace = replace_or_die


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["straight", "save", "resume"])
    parser.add_argument("--nvme", required=True)
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-at", default=None)
    parser.add_argument("--hidden", type=int, default=320)
    args = parser.parse_args()
    engine, batches = make_engine(args.nvme, NUM_MICRO_BATCHES, hidden=args.hidden, scheduler=WARMUP)
    consumed = 0
    if args.mode == "resume":
        _, client_state = engine.load_checkpoint(args.checkpoints)
        consumed = client_state["micro_batches_consumed"]
        for _ in range(consumed):
            next(batches)  # the data position the saved run had reached
    losses = []
    for _ in range(args.steps):
        losses.append(float(engine.train_batch(batches)))
        consumed += NUM_MICRO_BATCHES
    if args.mode == "save":
        engine.save_checkpoint(args.checkpoints, tag=f"step{engine.global_steps}",
                               client_state={"micro_batches_consumed": consumed})
    result = {"losses": losses, "global_steps": engine.global_steps, "step_count": engine.optimizer.step_count,
              "lr": engine.optimizer.param_groups[0]["lr"],
              "masters": {layer.index: engine.optimizer.read_master(layer) for layer in engine.layers}}
    torch.save(result, args.out)
    if args.kill_at:
        arm_kill(args.kill_at)
        engine.train_batch(batches)
        consumed += NUM_MICRO_BATCHES
        engine.save_checkpoint(args.checkpoints, tag=f"step{engine.global_steps}",
                               client_state={"micro_batches_consumed": consumed})
        raise SystemExit("the armed kill did not happen")
    engine.close()


if __name__ == "__main__":
    main()
