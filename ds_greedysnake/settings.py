"""ds_config, parsed once: what greedysnake reads of it, as one typed, frozen ``Settings``.

``initialize`` (and the planner's CLI, from its ``--config``) calls ``settings_from_ds_config`` once;
every module below them receives the ``Settings``, or the part it needs (``settings.aio`` for an
``SsdStore``, ``settings.greedysnake`` for the engine's choices), never the dict. Fields that DeepSpeed's
engine parses for itself (the batch sizes, gradient clipping, bf16) the vertical engine reads through
DeepSpeed's accessors (``engine.gradient_clipping()``), as DeepSpeed resolves them; they are here for
the planner, which plans a config without building an engine. Each field keeps the default its reader
used before it was parsed here. tests/unit/test_settings.py checks that no module below the entry points
reads a ds_config dict.
"""
import copy
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

import torch

from .config import GREEDYSNAKE_KEY, GreedySnakeConfig, GreedySnakeConfigError, parse_greedysnake_block
from .deepspeed_compat import (AioSettings, aio_settings, default_gradient_clipping, zero_min_swap_bytes,
                               zero_planner_defaults)


@dataclass(frozen=True)
class OptimizerBlock:
    """ds_config's ``"optimizer"`` block as written. Its params are checked and read where the vertical
    engine builds its Adam (``optimizer.adam_settings``), as before: DeepSpeed's own engine (the block
    off) takes params greedysnake does not know."""
    type: Optional[str] = None
    params: Tuple[Tuple[str, Any], ...] = ()

    def params_dict(self) -> Dict[str, Any]:
        return dict(self.params)


@dataclass(frozen=True)
class ZeroSettings:
    """What greedysnake reads of ``zero_optimization`` besides the checks at initialize
    (``config.check_ds_config``): the planner's ZeRO-Infinity baseline (DeepSpeed 0.19.8's defaults)
    and the folder its probe measures. Where a key is absent, the number is DeepSpeed's own default (its ZeRO
    config model, read by ``deepspeed_compat.zero_planner_defaults``)."""
    nvme_path: Optional[str]               # offload_param.nvme_path as written (None: not set)
    prefetch_bucket_size: float            # stage3_prefetch_bucket_size
    max_reuse_distance: float              # stage3_max_reuse_distance
    param_persistence_threshold: float     # stage3_param_persistence_threshold
    max_live_parameters: float             # stage3_max_live_parameters
    reduce_bucket_size: float              # reduce_bucket_size
    sub_group_size: float                  # sub_group_size: the optimizer's swap unit, in elements
    min_swap_bytes: int                    # tensors (and optimizer sub-groups) smaller stay in host memory


@dataclass(frozen=True)
class Settings:
    """Everything greedysnake reads of a ds_config; built by ``settings_from_ds_config``."""
    greedysnake: GreedySnakeConfig     # the "greedysnake" block, validated
    aio: AioSettings                   # the "aio" block with DeepSpeed's defaults
    bf16: bool                         # bf16.enabled: the compute dtype is bf16, else fp32 (fp16 is refused)
    train_batch_size: Optional[int]    # as written; None: not set
    train_micro_batch_size_per_gpu: Optional[int]
    gradient_accumulation_steps: Optional[int]
    gradient_clipping: float           # DeepSpeed's default where the key is absent; 0: off
    optimizer: OptimizerBlock
    zero: ZeroSettings

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the weights' on SSD and the layers'."""
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def micro_batch_size(self) -> int:
        """train_micro_batch_size_per_gpu, 1 where not set (the planner's workload)."""
        return 1 if self.train_micro_batch_size_per_gpu is None else self.train_micro_batch_size_per_gpu

    @property
    def micro_batches(self) -> int:
        """gradient_accumulation_steps (M), 1 where not set (the planner's workload)."""
        return 1 if self.gradient_accumulation_steps is None else self.gradient_accumulation_steps

    @property
    def batch_size_fixed(self) -> bool:
        """The config fixes the global batch (M is then not the planner's to choose)."""
        return self.gradient_accumulation_steps is not None or self.train_batch_size is not None

    def with_greedysnake(self, **fields: Any) -> "Settings":
        """These settings with ``fields`` set in the greedysnake block (validated as the block is)."""
        block = dict(self.greedysnake.model_dump(exclude_unset=True), **fields)
        return replace(self, greedysnake=parse_greedysnake_block(block))


def settings_from_ds_config(ds_config: Dict[str, Any]) -> Settings:
    """The one reader of a ds_config dict (a loaded ds_config.json). Errors of the greedysnake block are
    ``config.parse_greedysnake_config``'s; the rest of the config is checked for the vertical engine by
    ``config.check_ds_config`` at initialize."""
    zero = ds_config.get("zero_optimization") or {}
    offload = zero.get("offload_param") or {}
    optimizer = ds_config.get("optimizer") or {}
    aio = aio_settings(ds_config)
    return Settings(
        greedysnake=parse_greedysnake_block(ds_config.get(GREEDYSNAKE_KEY, {})),
        aio=aio,
        bf16=bf16_enabled(ds_config),
        train_batch_size=_optional_int(ds_config, "train_batch_size"),
        train_micro_batch_size_per_gpu=_optional_int(ds_config, "train_micro_batch_size_per_gpu"),
        gradient_accumulation_steps=_optional_int(ds_config, "gradient_accumulation_steps"),
        gradient_clipping=_number(ds_config.get("gradient_clipping", default_gradient_clipping()) or 0.0,
                                  "gradient_clipping"),
        optimizer=OptimizerBlock(optimizer.get("type"), tuple(copy.deepcopy(optimizer.get("params") or {}).items())),
        zero=ZeroSettings(nvme_path=offload.get("nvme_path"), min_swap_bytes=zero_min_swap_bytes(aio),
                          **{name: _zero_number(zero, key, default)
                             for name, (key, default) in zero_planner_defaults().items()}))


def bf16_enabled(ds_config: Dict[str, Any]) -> bool:
    """``bf16.enabled``; also for ``from_pretrained``, which picks the empty model's dtype before initialize."""
    return bool((ds_config.get("bf16") or {}).get("enabled", False))


def with_plan_applied(ds_config: Dict[str, Any], greedysnake: Dict[str, Any],
                      gradient_accumulation_steps: Optional[int]) -> Dict[str, Any]:
    """A copy of ``ds_config`` with the auto plan's block fields (and M, unless None) set: the dict
    DeepSpeed's engine is given, and the settings re-read from it."""
    applied = copy.deepcopy(ds_config)
    applied[GREEDYSNAKE_KEY] = dict(applied.get(GREEDYSNAKE_KEY) or {}, **greedysnake)
    if gradient_accumulation_steps is not None:
        applied["gradient_accumulation_steps"] = gradient_accumulation_steps
    return applied


def _optional_int(ds_config: Dict[str, Any], key: str) -> Optional[int]:
    value = ds_config.get(key)
    return None if value is None else int(_number(value, key))


def _zero_number(zero: Dict[str, Any], key: str, default: float) -> float:
    return _number(zero.get(key, default), f"zero_optimization.{key}")


def _number(value: Any, key: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise GreedySnakeConfigError(f"{key} must be a number, got {value!r}: set it to one "
                                     "(a Hugging Face \"auto\" is filled in by Trainer before initialize)") from None
