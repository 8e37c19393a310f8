"""The weights under the names of the module's ``state_dict()``, one layer at a time.

Greedysnake keeps each layer's weights as one flat vector on SSD (a shard per rank); outside the
moment a layer computes, the module's parameters hold empty placeholders. Everything that reads
weights from outside a step goes through here: ``engine.module.state_dict()``,
``deepspeed.zero.GatheredParameters`` over the engine's module, ``save_16bit_model``,
``_zero3_consolidated_16bit_state_dict`` and ``save_pretrained`` (export.py), and the export of a
saved checkpoint. A *layer source* says which parameters a layer holds, in its flat order, and reads
that layer's full fp32 master weights: the engine (from SSD, gathered over the ranks) and a saved
checkpoint are two sources.
"""
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from .. import deepspeed_compat
from .model_split import ModelSplit


class WeightsAccessError(RuntimeError):
    """The module's weights were asked for in a way that cannot give them; the message names the way that does."""


@dataclass
class LayerParams:
    """One layer's own parameters (not those it borrows) and their full shapes, in flat-vector order: the
    trainable ones first, then the frozen ones (LayerOwner's two vectors, one after the other)."""
    params: List[nn.Parameter]
    shapes: List[torch.Size]

    @property
    def numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes)

    @property
    def trainable_numel(self) -> int:
        return sum(shape.numel() for param, shape in zip(self.params, self.shapes) if param.requires_grad)


def layer_params_of(split: ModelSplit) -> List[LayerParams]:
    """Each layer's own parameters in the order LayerOwner flattens them (module.parameters(), less the
    borrowed ones; trainable, then frozen)."""
    result = []
    for index, module in enumerate(split.layers):
        borrowed = split.borrowed_by(index)
        own = [p for p in module.parameters() if all(p is not b for b in borrowed)]
        params = [p for p in own if p.requires_grad] + [p for p in own if not p.requires_grad]
        result.append(LayerParams(params, [deepspeed_compat.logical_shape(p) for p in params]))
    return result


@dataclass(frozen=True)
class ParamSlice:
    layer: int
    offset: int
    shape: torch.Size


class LayerSource:
    """Where a model's weights come from: its layers' parameters, and a reader of one layer's full fp32
    master vector (``read_master(index)``, exactly ``layers[index].numel`` elements, on the host; frozen
    weights, which have no master, as stored). ``read_trainable(index)``: its first ``trainable_numel``
    elements alone (default: read_master's, cut), so that the trainable weights come without reading the
    frozen ones. ``collective``: every rank must read every layer, in the same order (the engine on several
    ranks)."""

    def __init__(self, layers: List[LayerParams], read_master: Callable[[int], torch.Tensor], collective: bool = False,
                 read_trainable: Optional[Callable[[int], torch.Tensor]] = None):
        self.layers = layers
        self.read_master = read_master
        self.collective = collective
        self.read_trainable = read_trainable or (lambda index: read_master(index)[:layers[index].trainable_numel])


class WeightPlan:
    """The module's ``state_dict()`` keys, each mapped to a slice of a layer's flat vector (a parameter)
    or to the module's own tensor (a persistent buffer, never offloaded). Tied weights: several keys
    map to one parameter."""

    def __init__(self, module: nn.Module, source: LayerSource):
        self.module = module
        self.source = source
        self.slices: Dict[nn.Parameter, ParamSlice] = {}
        for index, layer in enumerate(source.layers):
            offset = 0
            for param, shape in zip(layer.params, layer.shapes):
                self.slices[param] = ParamSlice(index, offset, shape)
                offset += shape.numel()
        # keep_vars: the parameters and buffers themselves, so keys map to objects (aliases to the same one).
        self.entries: "OrderedDict[str, torch.Tensor]" = OrderedDict(module.state_dict(keep_vars=True))
        unknown = [key for key, value in self.entries.items()
                   if isinstance(value, nn.Parameter) and value not in self.slices]
        if unknown:
            raise WeightsAccessError(f"state_dict keys {unknown[:5]} are parameters of no layer of the split")

    def keys_of_layer(self, index: int) -> List[str]:
        return [key for key, value in self.entries.items()
                if isinstance(value, nn.Parameter) and self.slices[value].layer == index]

    def buffer_keys(self) -> List[str]:
        return [key for key, value in self.entries.items() if not isinstance(value, nn.Parameter)]

    def shape_of(self, key: str) -> torch.Size:
        value = self.entries[key]
        return self.slices[value].shape if isinstance(value, nn.Parameter) else value.shape

    def layer_values(self, index: int, dtype: torch.dtype,
                     trainable_only: bool = False) -> Dict[nn.Parameter, torch.Tensor]:
        """Layer ``index``'s parameters (``trainable_only``: its trainable ones) as separate host tensors in
        ``dtype``, from its master weights."""
        layer = self.source.layers[index]
        flat = self.source.read_trainable(index) if trainable_only else self.source.read_master(index)
        expected = layer.trainable_numel if trainable_only else layer.numel
        if flat.numel() != expected:
            raise WeightsAccessError(f"layer {index} read {flat.numel()} weights, its parameters hold {expected}")
        values = {}
        for param, shape in zip(layer.params, layer.shapes):
            if trainable_only and not param.requires_grad:
                continue
            start = self.slices[param].offset
            values[param] = flat[start:start + shape.numel()].view(shape).to(dtype, copy=True)
        return values

    def buffer_value(self, key: str) -> torch.Tensor:
        return self.entries[key].detach().to("cpu", copy=True)

    def state_dict(self, dtype: torch.dtype, keep: Callable[[], bool] = lambda: True,
                   exclude_frozen: bool = False) -> Optional["OrderedDict"]:
        """The whole state dict in ``dtype`` on the host, read layer by layer (aliases share one tensor,
        as in DeepSpeed's consolidated state dict); ``exclude_frozen``: without the frozen parameters (as
        DeepSpeed's ``exclude_frozen_parameters``), which are then not read. With ``keep()`` false (ranks
        other than 0 of a collective source) the layers are read and dropped and None is returned."""
        values: Dict[nn.Parameter, torch.Tensor] = {}
        for index in range(len(self.source.layers)):
            layer_values = self.layer_values(index, dtype, trainable_only=exclude_frozen)
            if keep():
                values.update(layer_values)
        if not keep():
            return None
        return OrderedDict((key, values[value] if isinstance(value, nn.Parameter) else self.buffer_value(key))
                           for key, value in self.entries.items()
                           if not (exclude_frozen and isinstance(value, nn.Parameter) and not value.requires_grad))


class ModuleWeightAccess:
    """Makes the engine's module give its real weights to ``state_dict()`` and to
    ``deepspeed.zero.GatheredParameters``, instead of the empty placeholders its parameters hold.

    * ``state_dict()`` (of the module or any submodule): hooks on every module put each parameter's
      current weights (the compute dtype, on the host) in place of its placeholder, reading each layer
      once per call (tied keys share one tensor). On several ranks the weights are sharded, and a
      state_dict() taken on one rank alone could only hang: it raises, naming the calls every rank
      makes together.
    * ``load_state_dict()`` raises, naming what loads weights into the engine.
    * ``GatheredParameters(params)``: every parameter carries the two calls DeepSpeed's context makes
      (deepspeed_compat.make_gatherable): on entry the parameters get their weights (on the device,
      gathered over the ranks: it is a collective, as in ZeRO-3), on exit the placeholders come back.
      Weights changed inside the context are not written back: that raises.
    """

    def __init__(self, module: nn.Module, plan: WeightPlan, compute_dtype: torch.dtype, device: torch.device,
                 world_size: int, is_resident: Callable[[int], bool], group=None):
        self._plan = plan
        self._compute_dtype = compute_dtype
        self._device = device
        self._world_size = world_size
        self._is_resident = is_resident
        self._depth = 0  # nesting of state_dict() calls in progress: the values read live for the outermost one
        self._values: Dict[nn.Parameter, torch.Tensor] = {}
        self._gathered: Dict[nn.Parameter, torch.Tensor] = {}
        self._handles = []
        # Functions, not bound methods: torch marks a post-hook by setting an attribute on it.
        before = lambda module, prefix, keep_vars: self._before_state_dict(module, prefix, keep_vars)  # noqa: E731
        after = lambda module, state_dict, prefix, metadata: self._after_state_dict(  # noqa: E731
            module, state_dict, prefix, metadata)
        for submodule in module.modules():
            self._handles.append(submodule.register_state_dict_pre_hook(before))
            self._handles.append(submodule.register_state_dict_post_hook(after))
            self._handles.append(submodule.register_load_state_dict_pre_hook(_refuse_load_state_dict))
        deepspeed_compat.make_gatherable({param: s.shape for param, s in plan.slices.items()}, group,
                                         self._gather, self._release)

    # ---------------------------------------------------------------- state_dict()

    def _before_state_dict(self, module, prefix, keep_vars) -> None:
        if not keep_vars and self._world_size > 1:
            raise WeightsAccessError(
                f"state_dict() of the greedysnake engine's module on {self._world_size} ranks: each rank holds a "
                "shard of every layer on its SSD. Call, on every rank together, engine.save_pretrained(dir) "
                "(Hugging Face safetensors, one layer in memory at a time), engine.save_16bit_model(dir), or "
                "engine._zero3_consolidated_16bit_state_dict() (the full state dict, on rank 0)")
        self._depth += 1

    def _after_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        try:
            for name, param in module._parameters.items():
                key = prefix + name
                if param is None or param not in self._plan.slices or key not in state_dict:
                    continue
                if state_dict[key] is param:
                    continue  # state_dict(keep_vars=True): the caller wants the parameter object itself
                state_dict[key] = self._current(param)
        finally:
            self._depth -= 1
            if self._depth <= 0:
                self._depth, self._values = 0, {}

    def _current(self, param: nn.Parameter) -> torch.Tensor:
        # Kept for the whole call: each layer is read once, and tied keys get one tensor, as in torch.
        if param not in self._values:
            self._values.update(self._plan.layer_values(self._plan.slices[param].layer, self._compute_dtype))
        return self._values[param]

    # ---------------------------------------------------------------- GatheredParameters

    def _gather(self, params: Sequence[nn.Parameter]) -> None:
        for layer in sorted({self._plan.slices[p].layer for p in params}):
            if self._is_resident(layer):
                continue  # a layer computing right now already holds its weights
            values = self._plan.layer_values(layer, self._compute_dtype)
            for param in params:
                if self._plan.slices[param].layer == layer and param not in self._gathered:
                    self._gathered[param] = param.data
                    param.data = values[param].to(self._device)

    def _release(self, params: Sequence[nn.Parameter], has_been_updated: bool) -> None:
        mine = [param for param in params if param in self._gathered]
        changed = []
        if has_been_updated:  # DeepSpeed says so whenever modifier_rank is given; check what really changed
            for layer in sorted({self._plan.slices[p].layer for p in mine}):
                values = self._plan.layer_values(layer, self._compute_dtype)
                changed += [self._name(p) for p in mine
                            if self._plan.slices[p].layer == layer and not torch.equal(p.data.cpu(), values[p])]
        for param in mine:
            param.data = self._gathered.pop(param)
        if changed:
            raise WeightsAccessError(
                f"weights {changed[:5]} were changed inside deepspeed.zero.GatheredParameters; greedysnake keeps "
                "its weights on SSD and does not write such changes back. To start from other weights use "
                "ds_greedysnake.initialize(..., pretrained=dir) or engine.load_checkpoint(...)")

    def _name(self, param: nn.Parameter) -> str:
        return next((key for key, value in self._plan.entries.items() if value is param), "?")


def _refuse_load_state_dict(module, *_args) -> None:
    raise WeightsAccessError(
        f"load_state_dict() into the greedysnake engine's module ({type(module).__name__}): its weights and "
        "optimizer states live on SSD, not in the module. Start from pretrained weights with "
        "ds_greedysnake.initialize(..., pretrained=dir) or ds_greedysnake.from_pretrained(dir, ...), or resume "
        "with engine.load_checkpoint(dir)")


def as_dtype(dtype: Union[str, torch.dtype, None], default: torch.dtype) -> torch.dtype:
    """``torch.bfloat16``, ``"bfloat16"``, ``"bf16"`` and the like; None: ``default``."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if str(dtype).lower() not in names:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(names)}")
    return names[str(dtype).lower()]
