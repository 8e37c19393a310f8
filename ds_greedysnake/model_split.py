"""Model -> the list of layers the vertical schedule runs: [input layer, blocks..., output layer]."""
from typing import List

from torch import nn


class ModelSplitError(ValueError):
    """The model cannot be run layer by layer; the message says what it needs."""


_WHAT_IS_NEEDED = (
    "greedysnake runs a model layer by layer and needs either a torch.nn.Sequential "
    "[embedding, block, ..., head] or a module with a method greedysnake_layers() returning that list "
    "(the first takes the micro-batch inputs, the middle ones map hidden state to hidden state, the last "
    "produces what loss_fn(output, labels) takes)")


def split_model(model: nn.Module) -> List[nn.Module]:
    if hasattr(model, "greedysnake_layers"):
        layers = list(model.greedysnake_layers())
        source = f"{type(model).__name__}.greedysnake_layers()"
    elif isinstance(model, nn.Sequential):
        layers = list(model)
        source = "the nn.Sequential"
    else:
        raise ModelSplitError(f"cannot split {type(model).__name__} into layers: {_WHAT_IS_NEEDED}")
    if len(layers) < 2:
        raise ModelSplitError(f"{source} gave {len(layers)} layer(s); at least 2 are needed. {_WHAT_IS_NEEDED}")
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ModelSplitError(f"layer {index} of {source} is a {type(layer).__name__}, not an nn.Module")
    _check_parameters_belong_to_one_layer(layers, model, source)
    return layers


def _check_parameters_belong_to_one_layer(layers: List[nn.Module], model: nn.Module, source: str) -> None:
    owner_of = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            if param in owner_of and owner_of[param][0] != index:
                raise ModelSplitError(
                    f"parameter {name} is shared by layers {owner_of[param][0]} and {index} (tied weights); "
                    "greedysnake keeps each layer's parameters in its own SSD region: untie them")
            owner_of[param] = (index, name)
    missing = [name for name, param in model.named_parameters() if param not in owner_of]
    if missing:
        raise ModelSplitError(
            f"parameters {missing[:5]} of the model belong to no layer of {source}; every trainable "
            "parameter must live in exactly one layer")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelSplitError("the model has no trainable parameters")
