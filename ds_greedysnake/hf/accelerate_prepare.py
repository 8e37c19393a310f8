"""accelerate scripts that do not use Trainer: ``ds_greedysnake.prepare(accelerator, ...)``.

An accelerate script with a DeepSpeed plugin builds its engine in ``accelerator.prepare``; with
``ds_greedysnake.prepare(accelerator, model, optimizer, loader, scheduler, loss_fn=...)`` instead, the
model's engine is the greedysnake engine when the config's ``"greedysnake"`` block enables it (and
DeepSpeed's otherwise). accelerate registers it as it registers DeepSpeed's, so ``accelerator.save_state``
and ``load_state`` save and resume it, with accelerate's RNG and sampler states beside it. The training
loop calls ``engine.train_batch(iterator)`` once per step instead of ``accelerator.backward`` and
``optimizer.step`` per micro-batch (those raise naming ``train_batch``).
"""
import logging
import os
from typing import Any, Callable, Dict, Optional

import torch
from deepspeed.accelerator import get_accelerator

from ..config import parse_greedysnake_config
from ..deepspeed_compat import deepspeed_initialize_routed
from ..initialize import initialize

logger = logging.getLogger(__name__)

# What accelerate 1.15's _prepare_deepspeed passes to deepspeed.initialize.
_ACCELERATE_KWARGS = {"model", "config_params", "config", "model_parameters", "lr_scheduler", "optimizer", "mpu"}


def count_ranks_on_the_cpu() -> None:
    """Give accelerate the number of ranks DeepSpeed runs on the CPU accelerator.

    accelerate 1.15's DeepSpeed path picks no communication backend where there is no GPU, and a state
    without a backend counts one process, although DeepSpeed has set torch.distributed up for all of them:
    every rank would get the whole dataset and save its RNG state under rank 0's name. Under DeepSpeed on
    the CPU, the counts are taken from torch.distributed (for greedysnake and for ZeRO-Infinity alike).
    """
    from accelerate.state import PartialState  # accelerate only where it is used
    if get_accelerator().device_name() != "cpu" or not torch.distributed.is_initialized():
        return
    state = PartialState()
    world_size = torch.distributed.get_world_size()
    if state.num_processes == world_size:
        return
    state.backend = torch.distributed.get_backend()
    state.num_processes = world_size
    state.process_index = torch.distributed.get_rank()
    state.local_process_index = int(os.environ.get("LOCAL_RANK", state.process_index))
    logger.info(f"accelerate counted 1 process under DeepSpeed on the CPU; set to the {world_size} ranks of "
                "torch.distributed")


def refuse_what_the_engine_cannot_take(kwargs: Dict[str, Any], error: type = ValueError) -> None:
    """What accelerate passes to ``deepspeed.initialize`` that the engine cannot take (a Python optimizer,
    sequence or tensor parallelism) raises ``error`` naming it."""
    if kwargs.get("optimizer") is not None:
        raise error("greedysnake steps with the ds_config \"optimizer\" block (AdamW), not an optimizer made in "
                    "Python: put the block in the config and pass accelerate.utils.DummyOptim(model.parameters()) "
                    "(Trainer: drop its optimizers= argument)")
    unknown = sorted(set(kwargs) - _ACCELERATE_KWARGS)
    if unknown or kwargs.get("mpu") is not None:
        raise error(f"accelerate asked for a DeepSpeed engine with {unknown or ['mpu']}, which greedysnake does "
                    "not support (sequence or tensor parallelism)")


def initialize_for_accelerate(kwargs: Dict[str, Any], loss_fn: Callable, error: type = ValueError,
                              pretrained: Optional[str] = None):
    """``ds_greedysnake.initialize`` for what accelerate passes to ``deepspeed.initialize``."""
    refuse_what_the_engine_cannot_take(kwargs, error)
    return initialize(model=kwargs["model"], model_parameters=kwargs.get("model_parameters"),
                      lr_scheduler=kwargs.get("lr_scheduler"),
                      config=kwargs.get("config_params") or kwargs.get("config"), loss_fn=loss_fn, pretrained=pretrained)


def prepare(accelerator, *objects, loss_fn: Callable, pretrained: Optional[str] = None):
    """``accelerator.prepare(*objects)``, whose one model gets the greedysnake engine when the DeepSpeed
    plugin's config enables the ``"greedysnake"`` block. Returns what ``accelerator.prepare`` returns: the
    engine, accelerate's optimizer and scheduler wrappers and the prepared data loaders.

    ``loss_fn(output, labels)``: the loss per micro-batch, as for ``ds_greedysnake.initialize``;
    ``pretrained``: a Hugging Face folder to start from (the model may then be on the meta device).
    The optimizer is ``accelerate.utils.DummyOptim`` over the config's ``"optimizer"`` block; a scheduler
    is the config's or ``DummyScheduler(optimizer, lr_scheduler_callable=...)``.
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError("ds_greedysnake.prepare needs an Accelerator with a DeepSpeed plugin: "
                         "Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=\"ds_config.json\")) or "
                         "accelerate launch --use_deepspeed --deepspeed_config_file ds_config.json")
    count_ranks_on_the_cpu()
    if not parse_greedysnake_config(plugin.deepspeed_config).enabled:
        return accelerator.prepare(*objects)
    models = [obj for obj in objects if isinstance(obj, torch.nn.Module)]
    if len(models) != 1:
        raise ValueError(f"ds_greedysnake.prepare takes one model (got {len(models)}): the greedysnake engine "
                         "trains one; prepare others with accelerator.prepare")

    def route(original, *args, **kwargs):
        if args or kwargs.get("model") is not models[0]:
            return original(*args, **kwargs)
        return initialize_for_accelerate(kwargs, loss_fn, pretrained=pretrained)

    with deepspeed_initialize_routed(route):
        return accelerator.prepare(*objects)
