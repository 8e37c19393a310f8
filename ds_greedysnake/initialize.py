"""``initialize``: deepspeed.initialize's signature, the vertical engine when the block enables it.

The ds_config is parsed here, once, into a ``settings.Settings``: the engine and everything below it
receive that, never the dict (which only DeepSpeed's own constructor reads)."""
import json
import os
import types
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, Optional, Union

import torch
import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist

from .config import check_ds_config
from .deepspeed_compat import parsed_ds_config, remove_shm_buffer_at_exit
from .runtime.engine import GreedySnakeEngine
from .models.model_split import split_model
from .models.pretrained import PretrainedWeights, empty_model, initialise_adapters_on_meta, leave_meta_device
from .settings import Settings, bf16_enabled, settings_from_ds_config, with_plan_applied


def load_config(config: Any) -> Dict[str, Any]:
    if isinstance(config, dict):
        return config
    if config is None:
        raise ValueError("a DeepSpeed config is required: pass config=\"ds_config.json\" or a dict")
    with open(config) as handle:
        return json.load(handle)


def initialize(args=None, model: torch.nn.Module = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, mpu=None, dist_init_required: Optional[bool] = None,
               collate_fn=None, config=None, loss_fn: Callable = None, pretrained: Optional[str] = None):
    """Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` like deepspeed.initialize.

    With ``"greedysnake": {"enabled": true}`` the engine is the vertical GreedySnakeEngine; otherwise
    it is DeepSpeed's own engine (ZeRO-Infinity for the same config) with a ``train_batch`` that runs
    the ordinary horizontal loop, so one script compares both.

    ``pretrained``: a Hugging Face folder of safetensors weights to start from instead of the model's
    own, read one layer at a time into the SSD regions (pretrained.py); the model may then have its
    parameters on the meta device (``ds_greedysnake.models.pretrained.empty_model(folder)``).
    """
    if model is None:
        raise ValueError("initialize needs a model")
    if loss_fn is None:
        raise ValueError("initialize needs loss_fn(output, labels): train_batch computes the loss per micro-batch")
    ds_config = load_config(config)
    settings = settings_from_ds_config(ds_config)
    greedysnake_config = settings.greedysnake
    remove_shm_buffer_at_exit()
    common = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu, collate_fn=collate_fn)
    if pretrained is not None and not greedysnake_config.enabled:
        raise ValueError(f"pretrained={pretrained!r} needs the greedysnake engine "
                         "(\"greedysnake\": {\"enabled\": true}); for DeepSpeed's own engine load the model with "
                         "AutoModelForCausalLM.from_pretrained")
    if pretrained is not None:
        initialise_adapters_on_meta(model)  # PEFT adapters over an empty model: the folder has none of them
    meta = [name for name, param in model.named_parameters() if param.is_meta]
    if meta and pretrained is None:
        raise ValueError(f"parameters {meta[:3]} of {type(model).__name__} are on the meta device (no weights): "
                         "pass pretrained=\"<folder with the safetensors weights>\" to initialize, or build the "
                         "model with weights")
    if not greedysnake_config.enabled:
        engine, engine_optimizer, loader, scheduler = deepspeed.initialize(
            dist_init_required=dist_init_required, config=ds_config, **common)
        engine.train_batch = types.MethodType(_horizontal_train_batch_with(loss_fn), engine)
        return engine, engine_optimizer, loader, scheduler
    nvme_path = check_ds_config(ds_config, get_accelerator().device_name())
    modules = split_model(model)  # a model that cannot be split fails here, before any DeepSpeed set-up
    weights = None
    if pretrained is not None:
        weights = PretrainedWeights(pretrained, model)  # checked here too, before any weight is read
        leave_meta_device(model, settings.dtype)
    select_device(args)  # before the planner's probe and NCCL touch the accelerator
    if greedysnake_config.auto:
        ds_config, settings = _apply_plan(ds_config, settings, modules, nvme_path)
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          dist_init_required=dist_init_required,
                          timeout=timedelta(seconds=settings.greedysnake.collective_timeout_seconds))
    engine = GreedySnakeEngine(settings, loss_fn, nvme_path, pretrained=weights,
                               dist_init_required=dist_init_required,
                               config=ds_config, config_class=parsed_ds_config(ds_config, mpu), **common)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def from_pretrained(model_dir: Union[str, os.PathLike], config, loss_fn=None, dtype: Optional[torch.dtype] = None,
                    **initialize_kwargs):
    """``initialize`` for an HF causal LM from a pretrained folder, never holding the model in host
    memory. ``config``: the ds_config (path or dict); ``loss_fn`` defaults to HF's causal LM loss;
    ``dtype`` of the (empty) model defaults to bf16 under a bf16 config, else fp32.
    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    from .models.hf import hf_causal_lm_loss
    ds_config = load_config(config)
    if dtype is None:
        dtype = torch.bfloat16 if bf16_enabled(ds_config) else torch.float32
    model = empty_model(str(model_dir), dtype)
    return initialize(model=model, config=ds_config, loss_fn=loss_fn or hf_causal_lm_loss, pretrained=model_dir,
                      **initialize_kwargs)


def select_device(args=None) -> None:
    """Make this rank's device current, as DeepSpeed's engine will (``args.device_rank``, else LOCAL_RANK).
    Until then every rank's current device is device 0: the planner's probe would time every rank's
    copies and layers on GPU 0 at once, and create a context there for each."""
    device_rank = getattr(args, "device_rank", None) if args is not None else None
    if device_rank is None:
        device_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_rank >= 0:
        get_accelerator().set_device(device_rank)


def _apply_plan(ds_config: Dict[str, Any], settings: Settings, modules, nvme_path: str):
    """``"auto": true``: the config with the plan applied (for DeepSpeed's engine, whose M the plan may set) and
    its settings."""
    from .planner.auto import auto_plan  # the planner (SciPy) only when asked for
    choice, _, lines = auto_plan(settings, modules, nvme_path)
    log_dist("greedysnake auto plan: " + "; ".join(lines), ranks=[0])
    applied = with_plan_applied(ds_config, choice.greedysnake, choice.gradient_accumulation_steps)
    return applied, settings_from_ds_config(applied)


def _horizontal_train_batch_with(loss_fn: Callable):
    def train_batch(engine, data_iter: Iterator) -> torch.Tensor:
        """DeepSpeed's ordinary loop: forward, backward and step per micro-batch; mean loss."""
        device = get_accelerator().current_device_name()
        losses = []
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, labels = next(data_iter)
            loss = loss_fn(engine(inputs.to(device)), labels.to(device))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        return torch.tensor(sum(losses) / len(losses))

    return train_batch
