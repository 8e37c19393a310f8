"""One rank of a data-parallel greedysnake run, for tests/e2e/test_data_parallel.py.

Started once per rank with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as the
deepspeed launcher sets them). Rank r takes micro-batches r, r+W, r+2W, ... of the shared stream,
so W ranks with M micro-batches each see exactly the micro-batches one rank with W*M sees.
Rank 0 writes losses, full fp32 weights and collective bytes per step to --out. ``--hf-family`` trains
a tiny Hugging Face model (tests/hf_models.py) instead of the tiny GPT: GPT-2's tied embeddings then
go across ranks.
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


def make_hf_engine(nvme_path: str, family: str, num_micro_batches: int, **greedysnake):
    from ds_greedysnake.models.hf import hf_causal_lm_loss
    from hf_models import hf_data, tiny_model
    os.makedirs(nvme_path, exist_ok=True)
    engine, _, _, _ = ds_greedysnake.initialize(model=tiny_model(family),
                                                config=ds_config(nvme_path, num_micro_batches, greedysnake=greedysnake),
                                                loss_fn=hf_causal_lm_loss)
    return engine, hf_data()


def export_weights(engine, folder: str, rank: int) -> dict:
    """Every way out, called on every rank as DeepSpeed's collectives are."""
    import deepspeed
    from ds_greedysnake.weights import WeightsAccessError
    engine.save_16bit_model(folder)
    engine.save_pretrained(os.path.join(folder, "hf"), max_shard_size="100KB")
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
    parser.add_argument("--last-rank-dies-after", type=int, default=None, help="steps; simulates a crash")
    parser.add_argument("--export", default=None, help="after training, every rank exports the weights here")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.hf_family:
        engine, stream = make_hf_engine(args.nvme, args.hf_family, args.micro_batches, collective_timeout_seconds=60)
    else:
        engine, stream = make_engine(args.nvme, args.micro_batches, greedysnake={"collective_timeout_seconds": 60})
    assert engine.parallel.world_size == world_size

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
    masters = engine.master_parameters()  # a collective: every rank takes part
    results = {"losses": losses, "masters": masters, "collective_bytes": collective_bytes}
    if args.export:
        results.update(export_weights(engine, args.export, rank))
    if rank == 0:
        torch.save(results, args.out)
    engine.close()


if __name__ == "__main__":
    main()
