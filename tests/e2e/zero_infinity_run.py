"""Train the tiny GPT with DeepSpeed's own ZeRO-Infinity (greedysnake disabled) on the same config."""
import os
from dataclasses import dataclass
from typing import Dict, List

import deepspeed
import torch

import ds_greedysnake
from ds_greedysnake.deepspeed_compat import count_zero_param_swap_reads
from ds_greedysnake.models.gpt import build_gpt, lm_loss
from helpers import data, ds_config, tiny_gpt_config


@dataclass
class BaselineRun:
    parameters: Dict[str, torch.Tensor]
    losses: List[float]
    param_reads: List[int]
    param_bytes_read: List[int]


def make_zero_infinity_engine(nvme_path: str, num_micro_batches: int, hidden: int = 320,
                              zero_overrides: Dict = None, **config_options):
    """DeepSpeed's ZeRO-Infinity engine (the block off) on the tiny GPT, and the GPT's config."""
    os.makedirs(nvme_path, exist_ok=True)
    config = tiny_gpt_config(hidden)
    ds = ds_config(nvme_path, num_micro_batches, enabled=False, **config_options)
    ds["zero_optimization"].update(zero_overrides or {})
    torch.manual_seed(0)
    # Under zero.Init: built plainly, ZeRO-3 on the CPU accelerator would give fp32 configs bf16 weights.
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = build_gpt(config)
    engine, _, _, _ = ds_greedysnake.initialize(model=model, model_parameters=model.parameters(), config=ds,
                                                loss_fn=lm_loss)
    return engine, config


def run_zero_infinity(nvme_path: str, num_micro_batches: int, steps: int, hidden: int = 320,
                      zero_overrides: Dict = None, **config_options) -> BaselineRun:
    engine, config = make_zero_infinity_engine(nvme_path, num_micro_batches, hidden, zero_overrides, **config_options)
    batches = data(config)
    losses, reads, read_bytes = [], [], []
    for _ in range(steps):
        with count_zero_param_swap_reads() as counter:
            losses.append(float(engine.train_batch(batches)))
        reads.append(counter.reads)
        read_bytes.append(counter.bytes)
    parameters = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            parameters[name] = param.detach().float().clone()
    return BaselineRun(parameters, losses, reads, read_bytes)
