"""``"greedysnake": {"enabled": true, "auto": true}``: plan at initialize and apply what the engine supports.

The plan sets ``deferred_layers``, ``activation_host_memory_mb``, ``gradient_host_memory_mb`` and
``optimizer_host_memory_mb`` (unless the block sets them itself), and M (``gradient_accumulation_steps``) only when ds_config fixes no batch size and one rank
runs: M is the global batch, a training decision, and every rank must agree on it. Parameters stay on
SSD (the engine has no host-resident placement for them yet), and so do the optimizer states of every
layer but the front ones the plan gives host memory.
"""
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from .cost_model import Workload
from .errors import PlannerError
from .hardware import Hardware, load_hardware
from ..settings import Settings
from .plan_config import DEFAULT_MICRO_BATCHES, PlanRequest, plan_for_settings, workload_from_settings
from .search import GIB, Plan
from .shapes import GPTShape


def shape_of(modules: List[nn.Module]) -> GPTShape:
    """The shape of a model split as [embedding, blocks..., head] from ``ds_greedysnake.models.gpt``."""
    from ..models.gpt import Block, Embedding, Head
    kinds = [type(module).__name__ for module in modules]
    if (len(modules) < 3 or not isinstance(modules[0], Embedding) or not isinstance(modules[-1], Head)
            or not all(isinstance(module, Block) for module in modules[1:-1])):
        raise PlannerError(f'"auto": true plans for the built-in GPT (Embedding, Blocks, Head); this model splits into '
                           f"{kinds[:4]}{'...' if len(kinds) > 4 else ''}: run python -m ds_greedysnake.plan --layers ... "
                           'and set deferred_layers and activation_host_memory_mb from its output instead')
    embedding, block = modules[0], modules[1]
    hidden = embedding.tokens.embedding_dim
    return GPTShape("this model", num_blocks=len(modules) - 2, hidden=hidden, heads=block.num_heads,
                    vocab=embedding.tokens.num_embeddings, seq_len=embedding.positions.num_embeddings,
                    mlp_ratio=block.up.out_features // hidden)


@dataclass(frozen=True)
class AutoChoice:
    """What the plan sets: block fields the block leaves unset, and M unless the config or the ranks fix it.
    ``initialize`` applies it to its ds_config (``settings.with_plan_applied``) and re-reads the settings."""
    greedysnake: Dict[str, Any]
    gradient_accumulation_steps: Optional[int]


def _hardware(settings: Settings, nvme_path: str, workload: Workload) -> Hardware:
    if settings.greedysnake.plan_hardware:
        return load_hardware(settings.greedysnake.plan_hardware)
    from .probe import probe_machine
    return probe_machine(nvme_path, settings, workload, quick=True)


def auto_plan(settings: Settings, modules: List[nn.Module], nvme_path: str) -> Tuple[AutoChoice, Plan, List[str]]:
    """What the plan sets, the plan, and one line per choice for the log."""
    block = settings.greedysnake
    given = block.model_fields_set  # the fields the block sets itself: kept
    shape = shape_of(modules)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    batch_fixed = settings.batch_size_fixed or world_size > 1
    workload = workload_from_settings(settings, shape)
    hardware = _hardware(settings, nvme_path, workload)
    budget = block.plan_host_memory_gb
    request = PlanRequest(shape, hardware, None if budget is None else float(budget) * GIB,
                          [workload.micro_batches] if batch_fixed else list(DEFAULT_MICRO_BATCHES))
    plan = plan_for_settings(settings, request)[0]
    applied: Dict[str, Any] = {}
    chosen = plan.greedysnake_block()
    lines = [f"planned with {hardware.name}: predicted {plan.prediction.seconds:.3f} s/step, "
             f"{plan.prediction.tokens_per_second:.1f} tokens/s (binds: {plan.prediction.binding}); "
             f"ZeRO-Infinity predicted {plan.zero_infinity.seconds:.3f} s/step"]
    for key in ("deferred_layers", "activation_host_memory_mb", "gradient_host_memory_mb", "optimizer_host_memory_mb"):
        if key in given:
            lines.append(f"{key} = {getattr(block, key)} (set in the block; the plan's {chosen[key]} not applied)")
        else:
            applied[key] = chosen[key]
            lines.append(f"{key} = {chosen[key]} (planned)")
    if batch_fixed:
        lines.append(f"gradient_accumulation_steps = {plan.micro_batches} (kept: the config or the rank count fixes it)")
    else:
        lines.append(f"gradient_accumulation_steps = {plan.micro_batches} (planned: smallest M within 95% of the best)")
    lines.append(f"optimizer states of {plan.optimizer_host_layers} front layer(s) in host memory, the others and every "
                 "parameter on SSD (host-resident parameters: modelled, not implemented)")
    return AutoChoice(applied, None if batch_fixed else plan.micro_batches), plan, lines
