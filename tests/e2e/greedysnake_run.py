"""Train the tiny GPT with greedysnake for a few steps; shared by the end-to-end tests."""
import os
from dataclasses import dataclass
from typing import Dict, List

import torch

import ds_greedysnake
from ds_greedysnake.models.gpt import lm_loss
from helpers import data, ds_config, fresh_model, tiny_gpt_config


@dataclass
class Run:
    masters: Dict[str, torch.Tensor]
    losses: List[float]
    metrics: list
    engine: object


def make_engine(nvme_path: str, num_micro_batches: int, hidden: int = 320, **config_options):
    """A greedysnake engine on the tiny GPT and the matching endless micro-batches."""
    os.makedirs(nvme_path, exist_ok=True)
    config = tiny_gpt_config(hidden)
    engine, _, _, _ = ds_greedysnake.initialize(model=fresh_model(config),
                                                config=ds_config(nvme_path, num_micro_batches, **config_options),
                                                loss_fn=lm_loss)
    return engine, data(config)


def run_greedysnake(nvme_path: str, num_micro_batches: int, steps: int, hidden: int = 320, **config_options) -> Run:
    engine, batches = make_engine(nvme_path, num_micro_batches, hidden, **config_options)
    losses, metrics = [], []
    for _ in range(steps):
        losses.append(float(engine.train_batch(batches)))
        metrics.append(engine.last_step_metrics)
    return Run(engine.master_parameters(), losses, metrics, engine)
