"""What one micro-batch brings into a step besides the first layer's input, and what its loss gives back.

In: a micro-batch's inputs are a tensor (the first layer's input) or a mapping with that tensor under
``"input_ids"`` and side inputs beside it (a padding ``attention_mask``, packed ``position_ids``, the
varlen kernels' ``cu_seq_lens_*``). Every layer sees the side inputs of the micro-batch it runs on
through ``side_inputs()``, set by the executor around each forward, recompute and loss: a layer keeps
the signature hidden -> hidden. A layer module lists the side inputs it reads in its ``side_inputs``
attribute; the engine refuses a micro-batch carrying one that no layer reads (it would be ignored).

Out: ``loss_fn`` may return ``LossWithMetrics``, the loss and scalar metrics of that micro-batch
computed where the head's output is (a count of correct tokens, an entropy sum); the engine reads them
with the losses in the step's one read of the host and sums them over ranks
(``engine.last_micro_batch_metrics``).
"""
import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Mapping, Tuple

import torch
from deepspeed.accelerator import get_accelerator

FIRST_LAYER_INPUT = "input_ids"

_current: contextvars.ContextVar = contextvars.ContextVar("greedysnake_side_inputs", default=None)
_NONE: Mapping[str, Any] = {}


@dataclass
class LossWithMetrics:
    """What a ``loss_fn`` returns to hand back metrics next to the loss: ``metrics`` maps names to scalar
    tensors (sums over the micro-batch's tokens, so that a sum over micro-batches and ranks means something;
    taken detached)."""
    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor] = field(default_factory=dict)


def split_loss(result) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of what ``loss_fn`` returned: a tensor, or a LossWithMetrics."""
    if isinstance(result, LossWithMetrics):
        for name, value in result.metrics.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError(f"loss_fn's metric {name!r} is {type(value).__name__} "
                                 f"{tuple(getattr(value, 'shape', ()))}: each metric must be a one-element tensor")
        return result.loss, {name: value.detach() for name, value in result.metrics.items()}
    return result, {}


def first_layer_input(inputs) -> torch.Tensor:
    return inputs[FIRST_LAYER_INPUT] if isinstance(inputs, Mapping) else inputs


def token_count(inputs) -> int:
    return first_layer_input(inputs).numel()


def side_inputs() -> Mapping[str, Any]:
    """The side inputs of the micro-batch the current layer runs on (empty outside a step or without any)."""
    current = _current.get()
    return _NONE if current is None else current


def side_input_on_host(name: str):
    """The host tensor the current micro-batch's side input ``name`` was copied to the device from (the
    side input itself where it came as given), or None without it. A layer decides from it what depends
    on the values (is a padding mask all ones, do positions restart) without a read of the device, which
    would make the host wait for the device's queued work once per layer and micro-batch."""
    current = side_inputs()
    return getattr(current, "on_host", current).get(name)


class SideInputs(dict):
    """One micro-batch's side inputs as the layers read them, with the tensors they were copied from."""

    def __init__(self, given: Mapping[str, Any], on_host: Mapping[str, Any]):
        super().__init__(given)
        self.on_host = on_host


class DeviceInputs(dict):
    """A micro-batch's inputs on the device (``to_device`` of a mapping), with the mapping it copied."""

    def __init__(self, on_device: Mapping[str, Any], on_host: Mapping[str, Any]):
        super().__init__(on_device)
        self.on_host = on_host


@contextmanager
def running_on(inputs):
    """Within: ``side_inputs()`` are those of the micro-batch whose inputs are ``inputs``."""
    if isinstance(inputs, Mapping):
        on_host = getattr(inputs, "on_host", inputs)
        given = SideInputs({key: value for key, value in inputs.items() if key != FIRST_LAYER_INPUT},
                           {key: value for key, value in on_host.items() if key != FIRST_LAYER_INPUT})
    else:
        given = None
    token = _current.set(given)
    try:
        yield
    finally:
        _current.reset(token)


def to_device(value, device):
    """A tensor, or each tensor of a mapping, on ``device`` (other values, such as ints, as they are); a
    mapping comes back as ``DeviceInputs``, which keeps the host tensors (``side_input_on_host``).

    From the host to another device the copy is made from pinned memory without blocking: from pageable
    memory a copy makes the host wait for every kernel queued on the device before it (once per micro-batch
    and tensor). torch's caching host allocator reuses the pinned block only once the copy has read it."""
    if isinstance(value, Mapping):
        return DeviceInputs({key: to_device(item, device) for key, item in value.items()}, value)
    if not isinstance(value, torch.Tensor):
        return value
    device = torch.device(device)
    if value.device.type == "cpu" and device.type != "cpu":
        return get_accelerator().pin_memory(value).to(device, non_blocking=True)
    return value.to(device)


def check_inputs(inputs, readable: Iterable[str]) -> None:
    """ValueError naming what ``inputs`` carries that no layer reads, or a missing first-layer input."""
    if not isinstance(inputs, Mapping):
        if not isinstance(inputs, torch.Tensor):
            raise ValueError(f"a micro-batch's inputs are {type(inputs).__name__}: give a tensor (the first layer's "
                             f"input) or a dict with it under {FIRST_LAYER_INPUT!r}")
        return
    if not isinstance(inputs.get(FIRST_LAYER_INPUT), torch.Tensor):
        raise ValueError(f"a micro-batch's inputs {sorted(inputs)} have no tensor {FIRST_LAYER_INPUT!r}, the first "
                         "layer's input")
    unread = sorted(set(inputs) - {FIRST_LAYER_INPUT} - set(readable))
    if unread:
        raise ValueError(f"a micro-batch carries {unread}, which no layer of this model reads (each layer module "
                         f"lists what it reads in 'side_inputs'; these read {sorted(set(readable)) or 'none'}): "
                         "drop them from the batch, or give the layers that need them a 'side_inputs' attribute")
