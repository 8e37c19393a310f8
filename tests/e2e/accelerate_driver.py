"""One accelerate script without Trainer, for tests/e2e/test_accelerate_state.py.

``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))`` and ``ds_greedysnake.prepare`` over
the tiny GPT, DummyOptim and DummyScheduler (the config's AdamW and WarmupLR) and a DataLoader; each
step is ``engine.train_batch``. ``--save-after N`` calls ``accelerator.save_state(--state)`` after step N
(twice, into the same folder: a second save overwrites the first); ``--resume`` starts with
``accelerator.load_state(--state)`` and skips the batches the saved steps took. Started directly (one
rank) or by ``deepspeed --num_gpus N``. Rank 0 writes the losses, the learning rates and the fp32
masters to ``--out``.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402

MICRO_BATCHES = 2


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvme", required=True)
    parser.add_argument("--state", required=True, help="accelerator.save_state / load_state folder")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True, help="steps this run trains")
    parser.add_argument("--save-after", type=int, default=0)
    parser.add_argument("--resume", type=int, default=0, help="load_state first; the saved run's steps")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser.parse_args()


def main():
    args = parse_args()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    import ds_greedysnake
    from ds_greedysnake.models.gpt import lm_loss
    from helpers import ds_config, fresh_model, tiny_gpt_config

    config = tiny_gpt_config(64)
    world_size = int(os.environ["WORLD_SIZE"])
    ds = ds_config(args.nvme, MICRO_BATCHES, scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4}})
    ds["train_batch_size"] = ds["train_micro_batch_size_per_gpu"] * MICRO_BATCHES * world_size
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
    model = fresh_model(config)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (64, config.seq_len + 1), generator=generator)
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    loader = torch.utils.data.DataLoader(dataset, batch_size=ds["train_micro_batch_size_per_gpu"], shuffle=False)
    optimizer = DummyOptim(model.parameters())
    engine, optimizer, loader, scheduler = ds_greedysnake.prepare(
        accelerator, model, optimizer, loader, DummyScheduler(optimizer), loss_fn=lm_loss)
    batches = iter(loader)
    if args.resume:
        accelerator.load_state(args.state)
        batches = iter(accelerator.skip_first_batches(loader, args.resume * MICRO_BATCHES))
    losses, rates = [], []
    for step in range(1, args.steps + 1):
        rates.append(optimizer.param_groups[0]["lr"])
        losses.append(float(engine.train_batch(batches)))
        if step == args.save_after:
            accelerator.save_state(args.state)
            accelerator.save_state(args.state)
    masters = engine.master_parameters()
    try:  # the per-micro-batch loop of an accelerate script: refused, naming the whole-step call
        accelerator.backward(torch.ones((), requires_grad=True))
        backward_error = None
    except RuntimeError as error:
        backward_error = str(error)
    result = {"engine": type(engine).__name__, "losses": losses, "rates": rates, "masters": masters,
              "processes": accelerator.num_processes, "state_files": sorted(os.listdir(args.state)),
              "backward_error": backward_error}
    engine.close()
    if accelerator.is_main_process:
        torch.save(result, args.out)


if __name__ == "__main__":
    main()
