"""DeepSpeed's ``zero_to_fp32`` for greedysnake checkpoints: the same command line, functions and outputs.

Every folder ``engine.save_checkpoint(dir)`` writes into gets a ``zero_to_fp32.py`` (``RECOVERY_SCRIPT``),
as DeepSpeed's engine copies its own there, so what Trainer's log and DeepSpeed's docs say works::

    python checkpoint-6/zero_to_fp32.py checkpoint-6 out_dir [--safe_serialization] [-t TAG] [--max_shard_size 5GB]

It writes what DeepSpeed's tool writes: ``pytorch_model.bin`` (or ``model.safetensors``), or shards
``pytorch_model-00001-of-0000N.bin`` / ``model-00001-of-0000N.safetensors`` with their
``*.index.json``, split by huggingface_hub's rule as DeepSpeed splits them. The fp32 master weights are
read from the checkpoint's shards one parameter at a time and each output shard is written as soon as
it is read: host memory holds one output shard, never the model (DeepSpeed's tool loads every rank's
whole optimizer file). The names come from the checkpoint itself (``weights_index.json``), so no model
or config is needed.

``get_fp32_state_dict_from_zero_checkpoint``, ``convert_zero_checkpoint_to_fp32_state_dict`` and
``load_state_dict_from_zero_checkpoint`` have DeepSpeed's signatures; ``from ds_greedysnake import ...``
in place of ``from deepspeed.utils.zero_to_fp32 import ...``.

Two differences, both said aloud rather than silent: greedysnake's checkpoints hold the trainable
parameters only (frozen ones come back from the base model), so without ``exclude_frozen_parameters``
a checkpoint of a model with frozen parameters is refused, naming them; and safetensors cannot hold
two names of one tensor, so ``--safe_serialization`` writes a tied weight once, under the name
``save_pretrained`` keeps (``from_pretrained`` ties it again), where the ``.bin`` output holds every
alias sharing one tensor, as DeepSpeed's does.
"""
import argparse
import json
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from ..storage.checkpoint_format import (BUFFERS, DEEPSPEED_DECOY, RECOVERY_SCRIPT_NAME, WEIGHTS_INDEX, CheckpointError,
                                         SavedCheckpointV2, open_checkpoint)
from ..storage.checkpoint_format import RECOVERY_SCRIPT, write_recovery_script  # noqa: F401 (re-exported)
from .weights import WeightPlan, as_dtype

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "convert_zero_checkpoint_to_state_dict", "load_state_dict_from_zero_checkpoint", "RECOVERY_SCRIPT_NAME"]

DEFAULT_MAX_SHARD_SIZE = "5GB"  # DeepSpeed's default
INDEX_FORMAT = 1


class ZeroToFp32Error(ValueError):
    """A checkpoint or option zero_to_fp32 cannot convert; the message names it and what works."""


# ----------------------------------------------------------------------------- written with each checkpoint


def describe_weights(plan: WeightPlan) -> Tuple[Dict, Dict[str, torch.Tensor]]:
    """What ``weights_index.json`` holds, and the persistent buffers: every state_dict key of the module,
    each parameter once (its first key, or the one Hugging Face's save_pretrained keeps), the other keys
    of a tied parameter as aliases."""
    preferred = _kept_by_save_pretrained(plan)
    canonical: Dict[nn.Parameter, str] = {}
    for key, value in plan.entries.items():
        if not isinstance(value, nn.Parameter):
            continue
        if value not in canonical or (canonical[value] not in preferred and key in preferred):
            canonical[value] = key
    parameters = [{"key": key, "layer": plan.slices[param].layer, "offset": plan.slices[param].offset,
                   "shape": list(plan.slices[param].shape), "trainable": param.requires_grad}
                  for param, key in canonical.items()]
    aliases = {key: canonical[value] for key, value in plan.entries.items()
               if isinstance(value, nn.Parameter) and key != canonical[value]}
    buffers = {key: plan.buffer_value(key).contiguous() for key in plan.buffer_keys()}
    index = {"format_version": INDEX_FORMAT, "parameters": parameters, "aliases": aliases, "buffers": list(buffers)}
    return index, buffers


def _kept_by_save_pretrained(plan: WeightPlan) -> set:
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(plan.module, transformers.PreTrainedModel):
        return set()
    from .export import saved_keys
    return set(saved_keys(plan))


# ----------------------------------------------------------------------------- reading a checkpoint


@dataclass(frozen=True)
class _Entry:
    """One key of the output: a parameter (read from the checkpoint), a buffer, or an alias of a parameter."""
    key: str
    shape: Tuple[int, ...]
    source: str                   # the parameter or buffer key whose tensor this is
    layer: int = -1               # parameters: their layer and offset in its flat vector
    offset: int = 0
    buffer_dtype: Optional[torch.dtype] = None

    def nbytes(self, dtype: torch.dtype) -> int:
        """What the tensor takes in the output: floating values in ``dtype``, other buffers as they are."""
        kind = dtype if self.buffer_dtype is None or self.buffer_dtype.is_floating_point else self.buffer_dtype
        return _numel(self.shape) * torch.empty(0, dtype=kind).element_size()


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


class _Checkpoint:
    """A saved greedysnake checkpoint as a state dict of fp32 tensors, read one key at a time."""

    def __init__(self, checkpoint_dir: str, tag: Optional[str]):
        if tag is None:
            latest = os.path.join(checkpoint_dir, "latest")
            if not os.path.isfile(latest):
                raise ZeroToFp32Error(f"no tag given and no 'latest' file at {latest}: pass the folder that holds "
                                      "the global_step* folders (e.g. checkpoint-12), or the tag with -t")
            with open(latest) as handle:
                tag = handle.read().strip()
        self.folder = os.path.join(checkpoint_dir, str(tag))
        self.saved = open_checkpoint(self.folder)
        index_path = os.path.join(self.folder, WEIGHTS_INDEX)
        if not isinstance(self.saved, SavedCheckpointV2) or not os.path.isfile(index_path):
            raise ZeroToFp32Error(
                f"{self.folder} was saved by an older ds_greedysnake, without {WEIGHTS_INDEX} (the names of its "
                "weights): convert it with the model's config instead: python -m ds_greedysnake.export "
                f"--checkpoint {checkpoint_dir} --tag {tag} --model-config <folder with config.json> --out <dir>")
        with open(index_path) as handle:
            self.index = json.load(handle)
        self._buffers: Optional[Dict[str, torch.Tensor]] = None
        for layer in sorted({p["layer"] for p in self.index["parameters"] if p["trainable"]}):
            numel = self.saved.layer_numels[layer]
            self.saved.check_layer(layer, numel, 0, numel)  # every shard there and whole, before any output

    def entries(self, exclude_frozen: bool, with_aliases: bool) -> "OrderedDict[str, _Entry]":
        """The output's keys in DeepSpeed's order: buffers, parameters, then the aliases of tied ones."""
        frozen = [p["key"] for p in self.index["parameters"] if not p["trainable"]]
        if frozen and not exclude_frozen:
            raise ZeroToFp32Error(
                f"{self.folder} holds the trainable parameters only: greedysnake's save_checkpoint leaves the "
                f"{len(frozen)} frozen ones (such as {frozen[:3]}) to the base model they came from. Pass "
                "--exclude_frozen_parameters (exclude_frozen_parameters=True) for the trained ones alone, or write "
                "the whole model from the running engine with engine.save_pretrained(dir)")
        buffers = self.buffers()
        result: "OrderedDict[str, _Entry]" = OrderedDict(
            (key, _Entry(key, tuple(value.shape), key, buffer_dtype=value.dtype)) for key, value in buffers.items())
        kept = set()
        for param in self.index["parameters"]:
            if param["trainable"]:
                result[param["key"]] = _Entry(param["key"], tuple(param["shape"]), param["key"], param["layer"],
                                              param["offset"])
                kept.add(param["key"])
        if with_aliases:
            for alias, key in self.index["aliases"].items():
                if key in kept:
                    result[alias] = _Entry(alias, result[key].shape, key, result[key].layer, result[key].offset)
        return result

    def buffers(self) -> Dict[str, torch.Tensor]:
        if self._buffers is None:
            from safetensors.torch import load_file
            path = os.path.join(self.folder, BUFFERS)
            self._buffers = load_file(path) if self.index["buffers"] else {}
            self._buffers = OrderedDict((key, self._buffers[key]) for key in self.index["buffers"])
        return self._buffers

    def read(self, entry: _Entry) -> torch.Tensor:
        """The fp32 value of a parameter (only its own elements are read), or a buffer as saved."""
        if entry.buffer_dtype is not None:
            value = self.buffers()[entry.source]
            return value.float() if value.is_floating_point() else value
        numel = self.saved.layer_numels[entry.layer]
        flat = self.saved.read_master_range(entry.layer, numel, entry.offset, entry.offset + _numel(entry.shape))
        return flat.view(entry.shape)


class LazyTensor:
    """A parameter not read yet (``lazy_mode=True``, as DeepSpeed's GatheredTensor): ``.contiguous()`` reads it."""

    def __init__(self, checkpoint: _Checkpoint, entry: _Entry):
        self._checkpoint, self._entry = checkpoint, entry
        self.shape = torch.Size(entry.shape)
        self.dtype = entry.buffer_dtype if entry.buffer_dtype is not None and not entry.buffer_dtype.is_floating_point \
            else torch.float32

    def contiguous(self) -> torch.Tensor:
        return self._checkpoint.read(self._entry)


# ----------------------------------------------------------------------------- DeepSpeed's three functions


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False):
    """DeepSpeed's function of that name for a greedysnake checkpoint: the fp32 state dict of
    ``<checkpoint_dir>/<tag>`` (tag None: the one ``latest`` names), on the host, tied keys sharing one
    tensor. ``lazy_mode``: each value a LazyTensor whose ``.contiguous()`` reads it."""
    checkpoint = _Checkpoint(checkpoint_dir, tag)
    entries = checkpoint.entries(exclude_frozen_parameters, with_aliases=True)
    if lazy_mode:
        lazy = {key: LazyTensor(checkpoint, entry) for key, entry in entries.items() if entry.source == key}
        return OrderedDict((key, lazy[entry.source]) for key, entry in entries.items())
    values: Dict[str, torch.Tensor] = {}
    state_dict = OrderedDict()
    for key, entry in entries.items():
        if entry.source not in values:
            values[entry.source] = checkpoint.read(entries[entry.source])
        state_dict[key] = values[entry.source]
    return state_dict


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32,
                                          max_shard_size=DEFAULT_MAX_SHARD_SIZE, safe_serialization=False, tag=None,
                                          exclude_frozen_parameters=False) -> List[str]:
    """DeepSpeed's function: the checkpoint as ``torch.load``-able (or safetensors) state-dict files in
    ``output_dir``, sharded above ``max_shard_size`` (None: one file), floating values in ``dtype``.
    One output shard in host memory at a time. Returns the files written."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory
    dtype = as_dtype(str(dtype).replace("torch.", "") if not isinstance(dtype, torch.dtype) else dtype, torch.float32)
    checkpoint = _Checkpoint(checkpoint_dir, tag)
    # safetensors refuses two names of one tensor: a tied weight is written once there (from_pretrained ties it).
    entries = checkpoint.entries(exclude_frozen_parameters, with_aliases=not safe_serialization)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    if max_shard_size is None:
        files, weight_map, metadata = {weights_name: list(entries)}, None, None
    else:
        pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
        # huggingface_hub's split, as DeepSpeed's tool calls it: aliases share their parameter's storage id.
        split = split_state_dict_into_shards_factory(entries, get_storage_size=lambda entry: entry.nbytes(dtype),
                                                     get_storage_id=lambda entry: entry.source,
                                                     filename_pattern=pattern, max_shard_size=max_shard_size)
        files = split.filename_to_tensors
        weight_map, metadata = (split.tensor_to_filename, split.metadata) if split.is_sharded else (None, None)
    os.makedirs(output_dir, exist_ok=True)
    for name, keys in files.items():
        _write_shard(checkpoint, entries, keys, dtype, os.path.join(output_dir, name), safe_serialization)
    written = list(files)
    if weight_map is not None:
        index_name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        with open(os.path.join(output_dir, index_name), "w", encoding="utf-8") as handle:
            handle.write(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
        written.append(index_name)
    return written


def _write_shard(checkpoint: _Checkpoint, entries, keys: List[str], dtype: torch.dtype, path: str,
                 safe_serialization: bool) -> None:
    values: Dict[str, torch.Tensor] = {}
    tensors = OrderedDict()
    for key in keys:
        entry = entries[key]
        if entry.source not in values:
            value = checkpoint.read(entries[entry.source])
            values[entry.source] = value.to(dtype) if value.is_floating_point() else value
        tensors[key] = values[entry.source]
    if safe_serialization:
        from safetensors.torch import save_file
        save_file(tensors, path, metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size=DEFAULT_MAX_SHARD_SIZE,
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """DeepSpeed's function: ``convert_zero_checkpoint_to_state_dict`` in fp32."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32,
                                                 max_shard_size=max_shard_size, safe_serialization=safe_serialization,
                                                 tag=tag, exclude_frozen_parameters=exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """DeepSpeed's function: the checkpoint's fp32 weights loaded into ``model`` (moved to the host, as
    DeepSpeed does; ``strict=False``), which is returned. Frozen parameters keep the model's own values:
    a greedysnake checkpoint holds the trained ones only."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters=True)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


# ----------------------------------------------------------------------------- the command line


def main(argv=None) -> int:
    """DeepSpeed's zero_to_fp32.py command line."""
    parser = argparse.ArgumentParser(prog=RECOVERY_SCRIPT_NAME, description="Recover the fp32 weights of a "
                                     "ds_greedysnake checkpoint as a state dict (DeepSpeed's zero_to_fp32.py options)")
    parser.add_argument("checkpoint_dir", type=str,
                        help="path to the desired checkpoint folder, e.g., path/checkpoint-12")
    parser.add_argument("output_dir", type=str, help="directory to the pytorch fp32 state_dict output files "
                        "(e.g. path/checkpoint-12-output/)")
    parser.add_argument("--max_shard_size", type=str, default=DEFAULT_MAX_SHARD_SIZE,
                        help="The maximum size for a checkpoint before being sharded, digits followed by a unit "
                        "(like `5MB`); default 5GB")
    parser.add_argument("--safe_serialization", default=False, action="store_true",
                        help="Whether to save the model using `safetensors` or the traditional PyTorch way (that "
                        "uses `pickle`).")
    parser.add_argument("-t", "--tag", type=str, default=None,
                        help="checkpoint tag used as a unique identifier for checkpoint. e.g., global_step1")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="enable debug (print each file written)")
    args = parser.parse_args(argv)
    try:
        files = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                                           max_shard_size=args.max_shard_size,
                                                           safe_serialization=args.safe_serialization, tag=args.tag,
                                                           exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (ZeroToFp32Error, CheckpointError) as error:
        print(f"zero_to_fp32: {error}", file=sys.stderr)
        return 1
    for name in files if args.debug else ():
        print(os.path.join(args.output_dir, name))
    print(f"wrote {len(files)} file(s) of fp32 weights to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
