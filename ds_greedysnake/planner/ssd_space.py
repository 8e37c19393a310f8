"""The SSD bytes a configuration needs for a model shape, by kind: what ``initialize`` logs and checks for a
built model (``ssd_layout.py``), here for one that is not built (``python -m ds_greedysnake.plan``)."""
from typing import TYPE_CHECKING, Dict, Optional, Sequence

from ..runtime.schedule import layers_updated_after_decision
from ..storage.ssd_layout import STATE_PIECE_NUMEL, LayoutSettings, activation_spill_bytes, plan_layout
from .engine_model import EngineSettings

if TYPE_CHECKING:
    from ..settings import Settings

MIB = 2**20


def ssd_bytes(layer_numels: Sequence[int], settings: "Settings", micro_batches: int, checkpoint_bytes: int,
              block: Optional[dict] = None, world_size: int = 1,
              frozen_numels: Optional[Sequence[int]] = None) -> Dict[str, int]:
    """Bytes per kind on one rank's swap folder: the engine's layout for ``settings`` (their greedysnake block's
    fields replaced by ``block``'s where given) on layers of ``layer_numels`` trainable parameters (and
    ``frozen_numels`` frozen ones: a LoRA run's base), sharded over ``world_size`` ranks, and the spill of
    ``micro_batches`` micro-batches of layer inputs of ``checkpoint_bytes`` each."""
    settings = settings.with_greedysnake(**block) if block else settings
    engine = EngineSettings.from_settings(settings)
    greedysnake = settings.greedysnake
    compute_bytes = 2 if settings.bf16 else 4
    gradient_bytes = 4 if greedysnake.fp32_grad_accumulation else compute_bytes
    shards = [-(-numel // world_size) for numel in layer_numels]
    post_decision = layers_updated_after_decision(len(shards), engine.overlap, engine.deferred_layers, engine.clipping)
    frozen_shards = [-(-numel // world_size) for numel in frozen_numels] if frozen_numels is not None else None
    layout = plan_layout(shards, LayoutSettings(compute_bytes, gradient_bytes, post_decision,
                                                engine.gradient_host_bytes, engine.optimizer_host_bytes,
                                                STATE_PIECE_NUMEL), frozen_shards)
    activation_budget = float(greedysnake.activation_host_memory_mb) * MIB
    spill = activation_spill_bytes(len(shards) - 1, micro_batches, checkpoint_bytes, activation_budget)
    return layout.bytes_by_kind(spill)


def model_ssd_bytes(model, settings: "Settings", micro_batches: int, checkpoint_bytes: int,
                    world_size: int = 1) -> Dict[str, int]:
    """``ssd_bytes`` for a model split as the engine splits it (build it on the meta device to plan one that
    does not fit in memory); a tied output layer's borrowed parameters stay with layer 0."""
    from ..models.model_split import plan_split  # torch: only when a model is given
    split = plan_split(model)
    numels, frozen = [], []
    for index, layer in enumerate(split.layers):
        borrowed = {id(param) for param in split.borrowed_by(index)}
        own = [param for param in layer.parameters() if id(param) not in borrowed]
        numels.append(sum(param.numel() for param in own if param.requires_grad))
        frozen.append(sum(param.numel() for param in own if not param.requires_grad))
    return ssd_bytes(numels, settings, micro_batches, checkpoint_bytes, world_size=world_size, frozen_numels=frozen)


ZERO_MIN_SWAP_BYTES = 2**20  # DeepSpeed's MIN_AIO_BYTES: smaller tensors (and sub-groups) stay in host memory


def zero_infinity_ssd_bytes(param_numels: Sequence[int], bf16: bool, sub_group_size: int,
                            aio_block_size: int = 2**20) -> Dict[str, int]:
    """What ZeRO-Infinity (DeepSpeed 0.19.8, one rank) keeps in its swap folder once it has trained a step,
    by its rules: each parameter tensor of at least max(1 MiB, aio block size) in the compute dtype is
    swapped (2 or 4 B per element); parameters are grouped in order into optimizer sub-groups of at least
    ``sub_group_size`` elements, and each sub-group of at least that many bytes in fp32 swaps its master,
    exp_avg and exp_avg_sq (12 B) and, from the first backward on, its fp32 gradient (4 B). Without its
    alignment padding (a few KiB per file)."""
    threshold = max(ZERO_MIN_SWAP_BYTES, aio_block_size)
    width = 2 if bf16 else 4
    parameters = sum(width * numel for numel in param_numels if width * numel >= threshold)
    groups, current = ([sum(param_numels)], 0) if sub_group_size >= sum(param_numels) else ([], 0)
    for index, numel in enumerate(param_numels if not groups else ()):
        current += numel
        if current >= sub_group_size or index == len(param_numels) - 1:
            groups.append(current)
            current = 0
    swapped = sum(numel for numel in groups if 4 * numel >= threshold)
    return {"parameters": parameters, "optimizer states": 12 * swapped, "gradients": 4 * swapped,
            "activation spill": 0}
