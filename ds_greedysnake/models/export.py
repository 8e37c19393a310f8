"""Trained weights out as Hugging Face safetensors, one layer in memory at a time.

``write_hf_checkpoint`` writes what ``PreTrainedModel.save_pretrained`` would (sharded safetensors
with ``model.safetensors.index.json``, config.json, generation_config.json) from a layer source
(weights.py): the running engine (``engine.save_pretrained``) or a saved greedysnake checkpoint,
from the command line, the role DeepSpeed's ``zero_to_fp32.py`` plays::

    python -m ds_greedysnake.export --checkpoint CKPT_DIR --tag global_step100 \\
        --model-config HF_DIR --out OUT_DIR [--dtype bfloat16] [--max-shard-size 2GB]

The keys are the module's ``state_dict()`` keys less what HF leaves out on save (tied aliases, by
HF's own rule, and ``_keys_to_ignore_on_save``). Shards are planned up front from the shapes, filled
in layer order and written as soon as they are full: memory holds one layer and one shard.
"""
import argparse
import copy
import json
import os
import re
import sys
from typing import Dict, List, Tuple, Union

import torch
from torch import nn

from ..shared import INDEX_FILE, SINGLE_FILE
from .weights import LayerSource, WeightPlan, WeightsAccessError, as_dtype, layer_params_of

DEFAULT_MAX_SHARD_SIZE = "1GB"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def saved_keys(plan: WeightPlan) -> List[str]:
    """The state_dict keys HF's save_pretrained keeps for this model, in streaming order (layer by
    layer, then persistent buffers)."""
    from transformers import PreTrainedModel
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    model = plan.module
    if not isinstance(model, PreTrainedModel):
        raise WeightsAccessError(f"save_pretrained writes Hugging Face checkpoints; {type(model).__name__} is not a "
                                 "transformers PreTrainedModel: use engine.save_16bit_model(dir) instead")
    ignored = set(model._keys_to_ignore_on_save or ())
    # HF decides which alias of a tied weight to keep by pointer: one small real tensor per distinct
    # parameter or buffer stands in for it (aliases get the same one).
    stand_ins: Dict[int, torch.Tensor] = {}
    skeleton = {key: stand_ins.setdefault(id(value), torch.zeros(1))
                for key, value in plan.entries.items() if key not in ignored}
    kept = set(remove_tied_weights_from_state_dict(skeleton, model))
    ordered = [key for index in range(len(plan.source.layers)) for key in plan.keys_of_layer(index)]
    ordered += plan.buffer_keys()
    return [key for key in ordered if key in kept]


def plan_shards(sizes: List[Tuple[str, int]], max_bytes: int) -> List[List[str]]:
    """Consecutive keys into shards of at most ``max_bytes`` (a tensor larger than that gets a shard of
    its own), as HF shards a state dict."""
    shards: List[List[str]] = []
    filled = max_bytes + 1
    for key, size in sizes:
        if not shards or filled + size > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(key)
        filled += size
    return shards


def shard_names(count: int) -> List[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{number:05d}-of-{count:05d}.safetensors" for number in range(1, count + 1)]


def _max_bytes(max_shard_size: Union[int, str]) -> int:
    from transformers.utils.hub import convert_file_size_to_int
    size = convert_file_size_to_int(max_shard_size)
    if size <= 0:
        raise ValueError(f"max_shard_size ({max_shard_size!r}) must be positive, e.g. \"2GB\"")
    return size


def write_hf_checkpoint(plan: WeightPlan, out_dir: str, dtype: torch.dtype,
                        max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE, writer: bool = True) -> List[str]:
    """Write the weights of ``plan`` to ``out_dir`` as HF safetensors plus config; returns the files written.
    With a collective source every rank calls this and only the ``writer`` writes."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    model = plan.module
    keys = saved_keys(plan)
    element = torch.empty(0, dtype=dtype).element_size()
    is_param = {key: isinstance(plan.entries[key], nn.Parameter) for key in keys}
    sizes = [(key, plan.shape_of(key).numel() * (element if is_param[key] else plan.entries[key].element_size()))
             for key in keys]
    shards = plan_shards(sizes, _max_bytes(max_shard_size))
    names = shard_names(len(shards))
    shard_of = {key: number for number, shard in enumerate(shards) for key in shard}
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        _remove_stale_weights(out_dir, names)
    pending: Dict[str, torch.Tensor] = {}
    weight_map: Dict[str, str] = {}
    next_shard = 0

    def flush_full_shards() -> None:
        nonlocal next_shard
        while next_shard < len(shards) and all(key in pending for key in shards[next_shard]):
            tensors = {key: pending.pop(key).contiguous() for key in shards[next_shard]}
            # What HF does on save for models loaded with a weight conversion (a no-op for most).
            tensors = revert_weight_conversion(model, tensors)
            save_file(tensors, os.path.join(out_dir, names[next_shard]), metadata={"format": "pt"})
            weight_map.update({key: names[next_shard] for key in tensors})
            next_shard += 1

    for index in range(len(plan.source.layers)):
        wanted = [key for key in plan.keys_of_layer(index) if key in shard_of]
        if not wanted and not plan.source.collective:
            continue
        values = plan.layer_values(index, dtype)
        if writer:
            for key in wanted:
                pending[key] = values[plan.entries[key]]
            del values
            flush_full_shards()
    if writer:
        for key in plan.buffer_keys():
            if key in shard_of:
                pending[key] = plan.buffer_value(key)
        flush_full_shards()
        assert next_shard == len(shards) and not pending, (next_shard, len(shards), list(pending)[:3])
        if len(shards) > 1:
            index_content = {"metadata": {"total_parameters": sum(s.shape.numel() for s in plan.slices.values()),
                                          "total_size": sum(size for _, size in sizes)},
                             "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(out_dir, INDEX_FILE), "w") as handle:
                handle.write(json.dumps(index_content, indent=2, sort_keys=True) + "\n")
        save_config(model, out_dir, dtype)
    return names + ([INDEX_FILE] if len(shards) > 1 else [])


def write_peft_adapters(plan: WeightPlan, out_dir: str, dtype: torch.dtype, writer: bool = True) -> List[str]:
    """What ``PeftModel.save_pretrained`` writes (adapter_config.json and adapter_model.safetensors: the adapter
    weights only, under PEFT's keys), by PEFT itself, from the trainable weights: the frozen base is not read.
    ``plan.module`` is the PeftModel. With a collective source every rank calls this and only the ``writer``
    writes. Returns the files written."""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    state_dict = plan.state_dict(dtype, keep=lambda: writer, exclude_frozen=True)
    if writer:
        plan.module.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    return [SAFETENSORS_WEIGHTS_NAME, "adapter_config.json"]


def save_config(model: nn.Module, out_dir: str, dtype: torch.dtype) -> None:
    """config.json (with the weights' dtype and the model's class) and, for a generative model,
    generation_config.json."""
    config = copy.deepcopy(model.config)
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and model.can_generate():
        generation_config.save_pretrained(out_dir)


def _remove_stale_weights(out_dir: str, names: List[str]) -> None:
    """Shards and an index left by an earlier save into the same folder would mix with this one."""
    for name in os.listdir(out_dir):
        stale = (name == SINGLE_FILE or name == INDEX_FILE or _SHARD_NAME.fullmatch(name)) and name not in names
        if stale and not (name == INDEX_FILE and len(names) > 1):
            os.remove(os.path.join(out_dir, name))


# ----------------------------------------------------------------------------- from a saved checkpoint


def checkpoint_source(load_dir: str, tag: str, layers) -> LayerSource:
    from ..storage.checkpoint import read_full_layer
    return LayerSource(layers, lambda index: read_full_layer(load_dir, tag, index, layers[index].numel).master)


def export_checkpoint(load_dir: str, tag: str, model_config: str, out_dir: str, dtype: torch.dtype = torch.float32,
                      max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE) -> List[str]:
    """A greedysnake checkpoint (``load_dir/tag``) of the model described by ``model_config`` (a folder
    with config.json) as an HF checkpoint in ``out_dir``, one layer in memory at a time."""
    from .model_split import plan_split
    from .pretrained import empty_model
    model = empty_model(model_config, dtype)
    layers = layer_params_of(plan_split(model))
    plan = WeightPlan(model, checkpoint_source(load_dir, tag, layers))
    return write_hf_checkpoint(plan, out_dir, dtype, max_shard_size)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_greedysnake.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="the folder engine.save_checkpoint(dir) wrote into")
    parser.add_argument("--tag", required=True, help="the checkpoint's tag (a folder under --checkpoint, e.g. "
                        "global_step100; the 'latest' file there names the newest)")
    parser.add_argument("--model-config", required=True, help="a folder with the model's config.json")
    parser.add_argument("--out", required=True, help="the folder to write the HF checkpoint to")
    parser.add_argument("--dtype", default="float32", help="float32 (the fp32 master weights), bfloat16 or float16")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    files = export_checkpoint(args.checkpoint, args.tag, args.model_config, args.out, as_dtype(args.dtype, None),
                              args.max_shard_size)
    print(f"wrote {len(files)} weight file(s) and the config to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
