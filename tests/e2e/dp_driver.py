"""One rank of a data-parallel greedysnake run, for tests/e2e/test_data_parallel.py.

Started once per rank with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as the
deepspeed launcher sets them). Rank r takes micro-batches r, r+W, r+2W, ... of the shared stream,
so W ranks with M micro-batches each see exactly the micro-batches one rank with W*M sees.
Rank 0 writes losses, full fp32 weights and collective bytes per step to --out. ``--hf-family`` trains
a tiny Hugging Face model (tests/hf_models.py) instead of the tiny GPT: GPT-2's tied embeddings then
go across ranks. ``--load`` resumes from the checkpoint ``latest`` names (saved by any number of ranks),
``--save`` saves one after the steps; both carry the position in the shared stream in client_state.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402

import ds_greedysnake  # noqa: E402
from greedysnake_run import make_engine  # noqa: E402
from helpers import ds_config  # noqa: E402

# warmup_min_lr above 0: the weights move in the first steps too, so that a checkpoint of them holds
# weights that differ from the initial ones.
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 2e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 3}}


def make_hf_engine(nvme_path: str, family: str, num_micro_batches: int, lora: bool = False, **greedysnake):
    from ds_greedysnake.models.hf import hf_causal_lm_loss
    from hf_models import hf_data, lora_model, tiny_model
    os.makedirs(nvme_path, exist_ok=True)
    engine, _, _, _ = ds_greedysnake.initialize(model=lora_model(family) if lora else tiny_model(family),
                                                config=ds_config(nvme_path, num_micro_batches, greedysnake=greedysnake),
                                                loss_fn=hf_causal_lm_loss)
    return engine, hf_data()


def export_weights(engine, folder: str, rank: int) -> dict:
    """Every way out, called on every rank as DeepSpeed's collectives are."""
    import deepspeed
    from ds_greedysnake.models.weights import WeightsAccessError
    engine.save_16bit_model(folder)
    engine.save_pretrained(os.path.join(folder, "hf"), max_shard_size="100KB")  # a PEFT model: its adapters
    with deepspeed.zero.GatheredParameters(engine.module.parameters()):
        gathered = {name: param.detach().cpu().clone() for name, param in engine.module.named_parameters()}
    try:
        engine.module.state_dict()
        error = ""
    except WeightsAccessError as raised:
        error = str(raised)
    return {"gathered": gathered, "state_dict_error": error}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvme", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--micro-batches", type=int, required=True, help="per rank")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--hf-family", default=None, help="a tiny Hugging Face model of this family")
    parser.add_argument("--lora", action="store_true", help="with --hf-family: PEFT LoRA adapters, the base frozen")
    parser.add_argument("--last-rank-dies-after", type=int, default=None, help="steps; simulates a crash")
    parser.add_argument("--export", default=None, help="after training, every rank exports the weights here")
    parser.add_argument("--load", default=None, help="checkpoint folder to resume from")
    parser.add_argument("--save", default=None, help="checkpoint folder to save into after the steps")
    parser.add_argument("--warmup-lr", action="store_true", help="DeepSpeed's WarmupLR over 3 steps")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.hf_family:
        engine, stream = make_hf_engine(args.nvme, args.hf_family, args.micro_batches, args.lora,
                                        collective_timeout_seconds=60)
    else:
        scheduler = WARMUP if args.warmup_lr else None
        engine, stream = make_engine(args.nvme, args.micro_batches, greedysnake={"collective_timeout_seconds": 60},
                                     scheduler=scheduler)
    assert engine.parallel.world_size == world_size
    consumed = 0  # micro-batches of the shared stream, over all ranks
    if args.load:
        _, client_state = engine.load_checkpoint(args.load)
        consumed = client_state["micro_batches_consumed"]
        for _ in range(consumed):
            next(stream)

    def my_micro_batches():
        while True:
            group = [next(stream) for _ in range(world_size)]
            yield group[rank]

    batches = my_micro_batches()
    losses, collective_bytes = [], []
    for step in range(args.steps):
        if args.last_rank_dies_after == step and rank == world_size - 1:
            os._exit(3)
        before = dict(engine.parallel.bytes_by_collective)
        losses.append(float(engine.train_batch(batches)))
        collective_bytes.append({kind: total - before.get(kind, 0)
                                 for kind, total in engine.parallel.bytes_by_collective.items()})
        consumed += world_size * args.micro_batches
    if args.save:
        engine.save_checkpoint(args.save, tag=f"step{engine.global_steps}",
                               client_state={"micro_batches_consumed": consumed})
    masters = engine.master_parameters()  # a collective: every rank takes part
    results = {"losses": losses, "masters": masters, "collective_bytes": collective_bytes}
    if args.export:
        results.update(export_weights(engine, args.export, rank))
    if rank == 0:
        results.update({"global_steps": engine.global_steps, "step_count": engine.optimizer.step_count,
                        "lr": engine.optimizer.param_groups[0]["lr"]})
        torch.save(results, args.out)
    engine.close()


if __name__ == "__main__":
    main()
