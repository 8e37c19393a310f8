"""Pretrained Hugging Face weights in, for models bigger than host memory.

``ds_greedysnake.from_pretrained(model_dir, config=ds_config)`` builds the model with its parameters
on the meta device (no memory; buffers such as rotary tables are computed as usual) and starts the
engine from the safetensors shards in ``model_dir``: each layer's tensors are read from the shards,
cast to the compute dtype, written to that layer's SSD regions and dropped before the next layer is
read. Host memory holds about one layer, never the model. The same, for a model built by hand::

    model = ds_greedysnake.models.pretrained.empty_model("model_dir")   # or any model on the meta device
    engine, *_ = ds_greedysnake.initialize(model=model, config=ds_config, loss_fn=..., pretrained="model_dir")

A PEFT model over such a skeleton (``peft.get_peft_model(empty_model(dir), LoraConfig(...))``) works the same:
its base weights come from the folder under the base model's names (PEFT's ``base_layer`` wrappers seen
through), and its adapters, which the folder does not hold, start as PEFT initialises them
(``initialise_adapters_on_meta``) or with the values they already have.
"""
import contextlib
import json
import os
from typing import Dict, Iterator, List, Sequence, Tuple, Union

import torch
from torch import nn

from ..deepspeed_compat import logical_shape, mark_full_shape
from ..shared import INDEX_FILE, SINGLE_FILE


class PretrainedWeightsError(ValueError):
    """A pretrained folder that cannot initialise this model; the message names the folder and the fix."""


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device and their buffers where they would be.

    A parameter is created by its module as usual (an untouched allocation, no memory in use) and
    replaced by a meta tensor as it is registered, before the module initialises it.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_model(model_dir_or_config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM of ``model_dir_or_config`` (a folder with config.json, or a transformers config),
    its parameters on the meta device: the skeleton initialize(..., pretrained=...) fills in."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = model_dir_or_config
    if isinstance(config, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(config, local_files_only=True)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


class SafetensorsFolder:
    """The tensors of an HF checkpoint folder (``model.safetensors`` or shards with their index),
    each read on demand; a file is open only while its tensors are read."""

    def __init__(self, folder: str):
        self.folder = folder
        index_path, single_path = os.path.join(folder, INDEX_FILE), os.path.join(folder, SINGLE_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as handle:
                self.file_of: Dict[str, str] = json.load(handle)["weight_map"]
        elif os.path.isfile(single_path):
            from safetensors import safe_open
            with safe_open(single_path, framework="pt") as handle:
                self.file_of = {key: SINGLE_FILE for key in handle.keys()}
        else:
            found = sorted(os.listdir(folder)) if os.path.isdir(folder) else "no such folder"
            raise PretrainedWeightsError(
                f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE} (found: {found}); greedysnake reads "
                "safetensors checkpoints one layer at a time. A .bin checkpoint: load it once with "
                "AutoModelForCausalLM.from_pretrained and save it with save_pretrained (safetensors)")

    def shapes(self, keys: Sequence[str]) -> Dict[str, torch.Size]:
        shapes = {}
        for name, names in self._by_file(keys).items():
            with self._open(name) as handle:
                shapes.update({key: torch.Size(handle.get_slice(key).get_shape()) for key in names})
        return shapes

    def read(self, keys: Sequence[str]) -> Dict[str, torch.Tensor]:
        return dict(self.each(keys))

    def each(self, keys: Sequence[str]) -> Iterator[Tuple[str, torch.Tensor]]:
        """(key, tensor) one at a time, each file opened once: a caller that drops each tensor holds one."""
        for name, names in self._by_file(keys).items():
            with self._open(name) as handle:
                for key in names:
                    yield key, handle.get_tensor(key)

    def _by_file(self, keys: Sequence[str]) -> Dict[str, List[str]]:
        grouped: Dict[str, List[str]] = {}
        for key in keys:
            grouped.setdefault(self.file_of[key], []).append(key)
        return grouped

    def _open(self, name: str):
        from safetensors import safe_open
        path = os.path.join(self.folder, name)
        if not os.path.isfile(path):
            raise PretrainedWeightsError(f"{path}, named in {INDEX_FILE}, does not exist")
        return safe_open(path, framework="pt")


class PretrainedWeights:
    """Where each parameter of ``model`` is in a pretrained folder; checked in full (names and shapes,
    from the file headers) before anything is read, so a wrong folder fails at initialize."""

    def __init__(self, folder: Union[str, os.PathLike], model: nn.Module):
        from .model_split import peft_base_model
        self.files = SafetensorsFolder(str(folder))
        self.key_of: Dict[nn.Parameter, str] = {}
        # Parameters the folder does not hold that start from the module's own values (PEFT adapters).
        self.from_module: Dict[nn.Parameter, str] = {}
        base = peft_base_model(model)
        lookup = base if base is not None else model
        missing = []
        for names, param in _names_by_parameter(lookup):
            plain = [name.replace(f".{_PEFT_BASE_LAYER}.", ".") for name in names] if base is not None else names
            key = next((candidate for name in plain for candidate in _candidates(lookup, name)
                        if candidate in self.files.file_of), None)
            if key is not None:
                self.key_of[param] = key
            elif base is not None and param.requires_grad and not param.is_meta:
                self.from_module[param] = names[0]
            else:
                missing.append(names[0])
        if missing:
            raise PretrainedWeightsError(f"{folder} has no weights for {len(missing)} parameter(s) of "
                                         f"{type(model).__name__}, e.g. {missing[:5]}: is it this model's checkpoint?")
        shapes = self.files.shapes(list(self.key_of.values()))
        wrong = [(key, tuple(shapes[key]), tuple(_full_shape(param))) for param, key in self.key_of.items()
                 if shapes[key] != _full_shape(param)]
        if wrong:
            raise PretrainedWeightsError(f"{folder} has tensors of other shapes than {type(model).__name__}'s "
                                         f"(key, in the file, in the model): {wrong[:5]}")
        self._load_buffers(lookup)

    def _load_buffers(self, model: nn.Module) -> None:
        """Persistent buffers saved with the weights (rare; never trained) are copied into the model."""
        buffers = {key: value for key, value in model.state_dict(keep_vars=True).items()
                   if not isinstance(value, nn.Parameter) and key in self.files.file_of}
        for key, value in self.files.read(list(buffers)).items():
            with torch.no_grad():
                buffers[key].copy_(value)

    def flat_weights(self, params: Sequence[nn.Parameter], dtype: torch.dtype) -> torch.Tensor:
        """One layer's parameters, in this order, as one flat host vector in ``dtype`` (filled one tensor
        at a time: the layer and one of its tensors in memory)."""
        place = {}
        offset = 0
        flat_parts = []
        for param in params:
            numel = _full_shape(param).numel()
            if param in self.from_module:
                flat_parts.append((offset, param.detach().reshape(-1).to("cpu", dtype)))
            else:
                place[self.key_of[param]] = (offset, numel)
            offset += numel
        flat = torch.empty(offset, dtype=dtype)
        for start, values in flat_parts:
            flat[start:start + values.numel()].copy_(values)
        for key, tensor in self.files.each(list(place)):
            start, numel = place[key]
            flat[start:start + numel].copy_(tensor.reshape(-1))
            del tensor
        return flat


_PEFT_BASE_LAYER = "base_layer"  # what PEFT calls the wrapped module of a LoRA layer
_META_SAFE_LORA_INITS = (True, False, "gaussian")  # PEFT inits that do not read the base weights


def initialise_adapters_on_meta(model: nn.Module) -> List[str]:
    """Give PEFT LoRA adapters that are on the meta device (``get_peft_model`` over ``empty_model``) host
    memory and PEFT's own initialisation (``reset_lora_parameters`` with the adapter's ``init_lora_weights``):
    a pretrained folder has no weights for them. Returns the LoRA modules initialised."""
    from .model_split import peft_base_model
    if peft_base_model(model) is None:
        return []
    from peft.tuners.lora.layer import LoraLayer
    done = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in list(module.lora_A.keys()):
            parts = [module.lora_A[adapter], module.lora_B[adapter]]
            if not any(param.is_meta for part in parts for param in part.parameters()):
                continue
            init = model.peft_config[adapter].init_lora_weights
            if init not in _META_SAFE_LORA_INITS:
                raise ValueError(f"LoRA adapter {adapter!r} of {name} is on the meta device and its init_lora_weights "
                                 f"is {init!r}, which reads the base weights: use init_lora_weights=True or "
                                 "'gaussian' over a model on the meta device, or build the PEFT model with weights")
            for part in parts:
                part.to_empty(device="cpu")
            module.reset_lora_parameters(adapter, init)
            done.append(name)
    return done


def leave_meta_device(model: nn.Module, dtype: torch.dtype) -> None:
    """Give each meta-device parameter an empty host placeholder in ``dtype``, keeping the parameter
    object (what modules, the split and the optimizer hold) and its full shape (as zero.Init records
    it): the layer owners then set ``.data`` as for any parameter, which torch refuses from the meta
    device to another. Before the engine: DeepSpeed's engine keeps weak references to the parameters,
    and a tensor with weak references cannot be swapped."""
    for param in {id(p): p for p in model.parameters()}.values():
        if param.is_meta:
            shape = param.shape
            placeholder = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, placeholder)
            mark_full_shape(param, shape)


def _names_by_parameter(model: nn.Module):
    """(every name of a parameter, the parameter), tied aliases together."""
    names: Dict[nn.Parameter, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return [(found, param) for param, found in names.items()]


def _candidates(model: nn.Module, name: str) -> List[str]:
    """The name, then the name as a checkpoint of the base model (no ``<base_model_prefix>.``) has it."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    return [name, name[len(prefix):]] if prefix != "." and name.startswith(prefix) else [name]


def _full_shape(param: nn.Parameter) -> torch.Size:
    return logical_shape(param)


def __getattr__(name):
    # from_pretrained calls initialize, which builds on this module: it lives in initialize.py (an import
    # of it from here would be a circle). The old path still works for a user who asks for it.
    if name == "from_pretrained":
        from ..initialize import from_pretrained
        return from_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
