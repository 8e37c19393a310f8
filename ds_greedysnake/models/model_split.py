"""Model -> the list of layers the vertical schedule runs: [input layer, blocks..., output layer]."""
from dataclasses import dataclass, field
from typing import List, Tuple

from torch import nn

from ..shared import ModelSplitError

_WHAT_IS_NEEDED = (
    "greedysnake runs a model layer by layer and needs either a torch.nn.Sequential "
    "[embedding, block, ..., head], a decoder-only Hugging Face causal LM, or a module with a method "
    "greedysnake_layers() returning that list (the first takes the micro-batch inputs, the middle ones map "
    "hidden state to hidden state, the last produces what loss_fn(output, labels) takes)")


@dataclass(eq=False)
class Tie:
    """The last layer uses parameters owned by layer 0 (tied input/output embeddings): it borrows them.
    Layer 0 keeps them on SSD, in its optimizer state and its checkpoint; the borrower's gradient for
    them is added to layer 0's."""
    borrower: int
    lender: int
    params: Tuple[nn.Parameter, ...]
    names: Tuple[str, ...]


@dataclass
class ModelSplit:
    layers: List[nn.Module]
    ties: List[Tie] = field(default_factory=list)

    def borrowed_by(self, index: int) -> List[nn.Parameter]:
        return [param for tie in self.ties if tie.borrower == index for param in tie.params]

    def lenders_of(self, index: int) -> List[int]:
        return [tie.lender for tie in self.ties if tie.borrower == index]


def peft_base_model(model: nn.Module):
    """The model a PEFT wrapper (``peft.get_peft_model``) holds, or None for any other model."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return model.get_base_model() if isinstance(model, PeftModel) else None


def split_model(model: nn.Module) -> List[nn.Module]:
    return plan_split(model).layers


def plan_split(model: nn.Module) -> ModelSplit:
    """The layers and the parameters the head borrows from the input layer (tied embeddings)."""
    from .hf import hf_layers, is_hf_causal_lm

    base = peft_base_model(model)
    if base is not None:
        peft_config = getattr(model, "active_peft_config", None)
        if getattr(peft_config, "is_prompt_learning", False):
            raise ModelSplitError(f"{type(model).__name__} holds a prompt-learning adapter "
                                  f"({type(peft_config).__name__}), which adds virtual tokens in the PeftModel's own "
                                  "forward, outside the layers greedysnake runs: use an adapter inside the layers "
                                  "(LoRA, IA3, ...)")
        # PEFT injects its adapters into the base model's own modules (LoRA wraps each target Linear), so
        # the base model's split holds them: the PeftModel around it adds no parameter of its own.
        layers = plan_split(base).layers
        source = f"the split of {type(base).__name__} inside {type(model).__name__}"
    elif hasattr(model, "greedysnake_layers"):
        layers = list(model.greedysnake_layers())
        source = f"{type(model).__name__}.greedysnake_layers()"
    elif isinstance(model, nn.Sequential):
        layers = list(model)
        source = "the nn.Sequential"
    elif is_hf_causal_lm(model):
        layers = hf_layers(model)
        source = f"the Hugging Face split of {type(model).__name__}"
    else:
        raise ModelSplitError(f"cannot split {type(model).__name__} into layers: {_WHAT_IS_NEEDED}")
    if len(layers) < 2:
        raise ModelSplitError(f"{source} gave {len(layers)} layer(s); at least 2 are needed. {_WHAT_IS_NEEDED}")
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ModelSplitError(f"layer {index} of {source} is a {type(layer).__name__}, not an nn.Module")
    ties = _find_ties(layers, model, source)
    return ModelSplit(layers, ties)


def _find_ties(layers: List[nn.Module], model: nn.Module, source: str) -> List[Tie]:
    """Every parameter must belong to exactly one layer, except that the last layer may borrow from layer 0."""
    owner_of = {}
    borrowed = {}
    last = len(layers) - 1
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            if param in owner_of and owner_of[param][0] != index:
                lender = owner_of[param][0]
                if lender != 0 or index != last:
                    raise ModelSplitError(
                        f"parameter {name} is shared by layers {lender} and {index} (tied weights); greedysnake "
                        "keeps each layer's parameters in its own SSD region and supports only the last layer "
                        "borrowing from layer 0 (tied input/output embeddings): untie the others")
                borrowed[param] = owner_of[param][1]
                continue
            owner_of[param] = (index, name)
    missing = [name for name, param in model.named_parameters() if param not in owner_of]
    if missing:
        raise ModelSplitError(
            f"parameters {missing[:5]} of the model belong to no layer of {source}; every trainable "
            "parameter must live in exactly one layer")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelSplitError("the model has no trainable parameters")
    if not borrowed:
        return []
    if all(param in borrowed for param in layers[last].parameters()):
        raise ModelSplitError(f"layer {last} of {source} has only borrowed parameters; give it one of its own "
                              "or merge it into layer 0")
    return [Tie(last, 0, tuple(borrowed), tuple(borrowed.values()))]
