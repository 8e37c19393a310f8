"""Hugging Face decoder-only causal LMs as greedysnake layers: [input layer, one wrapper per block, head].

The pieces are found by structure, not by class name:
  * the decoder stack is the module holding the model's single nn.ModuleList of decoder blocks;
  * which of the stack's other modules run before the blocks (embeddings, positions, dropout) and
    which after them (final norm, output projection) is learned by running the model once on the
    meta device (no memory, no compute) and recording the order they are called in;
  * the LM head is ``get_output_embeddings()``.
The input layer runs the model's own forward up to the first block (so every family's embedding
arithmetic is HF's own code), each block wrapper builds what its block needs from the hidden state
alone (causal mask, position ids, rotary cos/sin from the model's rotary module, shared read-only),
and the head applies the post-block modules in traced order, then the LM head. With tied input and
output embeddings the head uses the embedding's weight: model_split records that layer 0 lends it.
"""
import copy
import inspect
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
from torch import nn

from .micro_batch import side_input_on_host, side_inputs as current_side_inputs
from ..shared import ModelSplitError

# The only per-family hint: attribute names under which a decoder stack keeps its rotary module
# (a parameterless module; several families share the name).
_ROTARY_ATTRIBUTES = ("rotary_emb",)
# What HfBlock builds for every block besides the hidden state (position_embeddings where there is a rotary module).
_BUILT_INPUTS = ("attention_mask", "position_ids", "use_cache")
# What a stack hands its blocks for generation with a cache only: training on full windows needs none of it.
_CACHE_INPUTS = ("past_key_values", "past_key_value", "layer_past", "cache", "cache_position")
# Side inputs of a micro-batch (micro_batch.py) that the model's forward reads as the split reads them: a
# padding mask and position ids (packed sequences restart them; the mask code then keeps each sequence to
# itself), into the input layer and every block.
_MASK_INPUTS = ("attention_mask", "position_ids")
# What a padding-free collator adds for the varlen attention kernels; the stack hands them to every block
# through its **kwargs (sdpa and eager ignore them).
_VARLEN_INPUTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# Config fields with which a family's CausalLM forward scales or caps the logits after the LM head, which
# the split's head does not apply: refused rather than trained on other logits.
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": None, "logits_scaling": 1.0,
                     "output_multiplier": None, "lm_head_multiplier": None}


def is_hf_causal_lm(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def hf_causal_lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal LM loss: ``labels`` are the input ids (HF shifts them by one inside; -100 is ignored).
    ``output`` is the head's logits, or the model's own output (for the plain DeepSpeed engine)."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    logits = getattr(output, "logits", output)
    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


def hf_layers(model: nn.Module) -> List[nn.Module]:
    """The layer list greedysnake runs for a decoder-only HF causal LM; ModelSplitError if it cannot."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise ModelSplitError(f"{name} is not a decoder-only causal LM (encoder-decoder or no config): greedysnake "
                              "splits decoder-only models; give the model a greedysnake_layers() method instead")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ModelSplitError(f"{name} mixes attention types {sorted(layer_types)}; the automatic split supports "
                              "full causal attention only")
    if getattr(config, "layerdrop", 0.0):
        raise ModelSplitError(f"{name} has layerdrop={config.layerdrop}: set config.layerdrop = 0 "
                              "(a layer skipped at random cannot be scheduled)")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field_name, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(text_config, field_name, None)
        if value is not None and value != neutral and value != 1.0:
            raise ModelSplitError(f"{name} has config.{field_name}={value}: its forward transforms the logits after "
                                  "the LM head, which the automatic split does not; give the model a "
                                  "greedysnake_layers() method instead")
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if lm_head is None:
        raise ModelSplitError(f"{name} has no output embeddings (get_output_embeddings() is None): "
                              "use the ...ForCausalLM class")
    stack_name, blocks_name = _find_blocks(model)
    stack = model.get_submodule(stack_name)
    blocks = getattr(stack, blocks_name)
    rotary = _find_rotary(stack, blocks[0])
    before, after, block_call, mask_reads_positions = _trace_stack_children(model, stack_name, blocks_name)
    builders, constants = _block_inputs(model, stack, blocks[0], block_call, rotary is not None)
    head_chain = [getattr(stack, child) for child in after]
    input_modules = {child: getattr(stack, child) for child in before}
    entry = model.base_model if model.base_model is not model else stack
    layers: List[nn.Module] = [HfInputLayer(entry, input_modules, blocks[0])]
    layers += [HfBlock(block, config, rotary, builders, constants, mask_reads_positions) for block in blocks]
    layers.append(HfHead(head_chain, lm_head))
    return layers


def _find_blocks(model: nn.Module):
    """(stack path, attribute) of the single ModuleList holding the decoder blocks."""
    num_layers = getattr(model.config, "num_hidden_layers", None)
    found = []
    for path, module in model.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child) > 0 and len(child) == num_layers:
                found.append((path, child_name))
    if len(found) != 1:
        listed = [f"{p}.{c}" if p else c for p, c in found]
        raise ModelSplitError(
            f"{type(model).__name__}: expected exactly one nn.ModuleList of config.num_hidden_layers ({num_layers}) "
            f"decoder blocks, found {len(found)} {listed}; give the model a greedysnake_layers() method instead")
    return found[0]


def _trace_stack_children(model: nn.Module, stack_name: str, blocks_name: str):
    """Names of the stack's children called before the first block and after the last one, in call order,
    the (args, kwargs) the first block was called with, and whether the stack builds its causal mask from
    the position ids (then packed sequences keep to themselves; OPT's does not), from one forward of a
    parameterless copy of the model on the meta device."""
    with torch.device("meta"):
        twin = type(model)(copy.deepcopy(model.config))
    stack = twin.get_submodule(stack_name)
    calls = []
    block_calls = []
    handles = [child.register_forward_hook(lambda *_, name=name: calls.append(name))
               for name, child in stack.named_children() if name != blocks_name]
    handles += [block.register_forward_hook(lambda *_: calls.append(blocks_name))
                for block in getattr(stack, blocks_name)]
    handles.append(getattr(stack, blocks_name)[0].register_forward_pre_hook(
        lambda _module, args, kwargs: block_calls.append((args, kwargs)), with_kwargs=True))
    family_module = sys.modules.get(type(stack).__module__)
    mask_builder = getattr(family_module, "create_causal_mask", None)
    mask_calls = []
    if callable(mask_builder):
        def recording_mask_builder(*args, **kwargs):
            mask_calls.append(kwargs.get("position_ids") is not None)
            return mask_builder(*args, **kwargs)
        setattr(family_module, "create_causal_mask", recording_mask_builder)
    try:
        # use_cache: without a cache, the mask code inspects position ids by value, which meta tensors lack.
        twin(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"), use_cache=True)
    except Exception as error:  # a model whose forward does not run on the meta device
        raise ModelSplitError(f"could not trace {type(model).__name__} on the meta device ({error}); "
                              "give the model a greedysnake_layers() method instead") from error
    finally:
        for handle in handles:
            handle.remove()
        if callable(mask_builder):
            setattr(family_module, "create_causal_mask", mask_builder)
    if blocks_name not in calls:
        raise ModelSplitError(f"{type(model).__name__}'s forward never called its decoder blocks")
    first = calls.index(blocks_name)
    last = len(calls) - 1 - calls[::-1].index(blocks_name)
    if calls[first:last + 1].count(blocks_name) != last - first + 1:
        raise ModelSplitError(f"{type(model).__name__} calls {[c for c in calls[first:last] if c != blocks_name]} "
                              "between its decoder blocks; such a model cannot be split into a chain of blocks")
    before = list(dict.fromkeys(calls[:first]))
    after = calls[last + 1:]
    if len(set(after)) != len(after):
        raise ModelSplitError(f"{type(model).__name__} calls {after} after its blocks; a chain of distinct "
                              "modules is needed")
    # A stack that builds its mask otherwise: as the split did before it read the masks' inputs.
    mask_reads_positions = mask_calls[0] if mask_calls else True
    return before, after, block_calls[0], mask_reads_positions


def _alibi_builder(stack: nn.Module):
    """ALiBi biases (BLOOM): the stack exposes build_alibi_tensor(attention_mask, num_heads, dtype)."""
    build, num_heads = getattr(stack, "build_alibi_tensor", None), getattr(stack, "num_heads", None)
    if not callable(build) or not isinstance(num_heads, int):
        return None
    return lambda hidden: build(torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device), num_heads,
                                dtype=hidden.dtype)


# Inputs a stack computes in its forward for every block, and how to build them where the stack says how.
_INPUT_BUILDERS = {"alibi": _alibi_builder}


def _block_inputs(model: nn.Module, stack: nn.Module, block: nn.Module, call, has_rotary: bool):
    """What HfBlock must add to the hidden state for this block: builders of inputs the stack computes
    (``{name: hidden -> value}``) and constants (a required input the stack passes as None or a flag).
    ModelSplitError, naming the model and the input, for any other input the block needs: better at
    initialize than a TypeError mid-step."""
    signature = inspect.signature(block.forward)
    named = [p for p in signature.parameters.values()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    built = set(_BUILT_INPUTS) | ({"position_embeddings"} if has_rotary else set())
    args, kwargs = call
    try:
        passed = dict(signature.bind_partial(*args, **kwargs).arguments)
    except TypeError as error:
        raise ModelSplitError(f"{type(model).__name__} calls its block {type(block).__name__} in a way its "
                              f"signature does not bind ({error})") from error
    for extra in signature.parameters.values():
        if extra.kind == inspect.Parameter.VAR_KEYWORD:
            passed.update(passed.pop(extra.name, {}))
        elif extra.kind == inspect.Parameter.VAR_POSITIONAL and not passed.get(extra.name):
            passed.pop(extra.name, None)
    hidden_name = named[0].name if named else None
    builders, constants = {}, {}
    for name, value in passed.items():
        if name in (hidden_name, *built, *_CACHE_INPUTS):
            continue
        if value is None or isinstance(value, bool):
            constants[name] = value  # replayed below only where the block requires the argument
            continue
        builder = _INPUT_BUILDERS[name](stack) if name in _INPUT_BUILDERS else None
        if builder is None:
            raise ModelSplitError(
                f"{type(model).__name__}: its stack's forward passes each decoder block ({type(block).__name__}) the "
                f"input '{name}' ({type(value).__name__}), which greedysnake's split does not build (it builds "
                f"{sorted(built)} from the hidden state); give the model a greedysnake_layers() method instead")
        builders[name] = builder
    required = [p.name for p in named[1:] if p.default is inspect.Parameter.empty and p.name not in built]
    missing = [name for name in required if name not in builders and name not in constants]
    if missing:
        raise ModelSplitError(f"{type(model).__name__}: its decoder block {type(block).__name__} requires the input(s) "
                              f"{missing}, which greedysnake's split does not build (it builds {sorted(built)}); "
                              "give the model a greedysnake_layers() method instead")
    return builders, {name: constants[name] for name in required if name in constants}


def _find_rotary(stack: nn.Module, first_block: nn.Module) -> Optional[nn.Module]:
    if "position_embeddings" not in inspect.signature(first_block.forward).parameters:
        return None
    for attribute in _ROTARY_ATTRIBUTES:
        rotary = getattr(stack, attribute, None)
        if isinstance(rotary, nn.Module) and not any(True for _ in rotary.parameters()):
            return rotary
    raise ModelSplitError(f"{type(first_block).__name__} takes position_embeddings but its stack "
                          f"{type(stack).__name__} has no parameterless rotary module named one of {_ROTARY_ATTRIBUTES}")


class _ReachedFirstBlock(Exception):
    def __init__(self, hidden: torch.Tensor):
        super().__init__("reached the first decoder block")
        self.hidden = hidden


class HfInputLayer(nn.Module):
    """Token ids -> the hidden state the model hands its first block, computed by the model's own forward
    (embeddings, learned positions, embedding dropout), stopped just before that block runs."""

    side_inputs = _MASK_INPUTS

    def __init__(self, entry: nn.Module, input_modules: dict, first_block: nn.Module):
        super().__init__()
        # Owned for their parameters; the entry module and the first block are only called, not owned.
        self.pieces = nn.ModuleDict({name.replace(".", "_"): module for name, module in input_modules.items()})
        self._entry = [entry]
        self._first_block = [first_block]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        def stop(_module, args, kwargs):
            raise _ReachedFirstBlock(args[0] if args else kwargs["hidden_states"])

        handle = self._first_block[0].register_forward_pre_hook(stop, with_kwargs=True)
        given = current_side_inputs()
        try:
            # The masks too: learned positions come from position_ids (GPT-2) or the padding mask (OPT).
            self._entry[0](input_ids=input_ids, use_cache=False,
                           **{name: given[name] for name in _MASK_INPUTS if name in given})
        except _ReachedFirstBlock as reached:
            return reached.hidden
        finally:
            handle.remove()
        raise ModelSplitError(f"{type(self._entry[0]).__name__}'s forward returned without calling its first block")


class HfBlock(nn.Module):
    """One decoder block as hidden -> hidden: builds the causal mask, position ids and rotary cos/sin
    the model's own forward would pass it (no padding mask, no cache: training on full windows), and the
    inputs ``builders`` make (ALiBi biases); ``constants`` are required inputs the stack passes as None."""

    def __init__(self, block: nn.Module, config, rotary: Optional[nn.Module],
                 builders: Optional[Dict[str, Callable]] = None, constants: Optional[Dict[str, Any]] = None,
                 mask_reads_positions: bool = True):
        super().__init__()
        self.block = block
        self._mask_reads_positions = mask_reads_positions
        self.rotary = rotary  # parameterless, shared by every block wrapper
        self._config = config
        self._builders = dict(builders or {})
        self._constants = dict(constants or {})
        takes_kwargs = any(parameter.kind == inspect.Parameter.VAR_KEYWORD
                           for parameter in inspect.signature(block.forward).parameters.values())
        self._varlen_inputs = _VARLEN_INPUTS if takes_kwargs else ()
        # Builders (ALiBi) make their input for full, unpadded sequences only: such a model takes no masks.
        self.side_inputs = (() if self._builders else _MASK_INPUTS) + self._varlen_inputs

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask
        given = current_side_inputs()
        # As the stack's forward: arange positions unless the batch gives its own, the causal mask from them
        # and the padding mask.
        position_ids = given.get("position_ids")
        padding_mask, mask_positions = self._mask_arguments(hidden, given.get("attention_mask"), position_ids)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        kwargs = {"attention_mask": create_causal_mask(config=self._config, inputs_embeds=hidden,
                                                       attention_mask=padding_mask, cache=None,
                                                       position_ids=mask_positions),
                  "position_ids": position_ids, "use_cache": False}
        kwargs.update({name: given[name] for name in self._varlen_inputs if name in given})
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden, position_ids=position_ids)
        kwargs.update({name: build(hidden) for name, build in self._builders.items()})
        kwargs.update(self._constants)
        output = self.block(hidden, **kwargs)
        return output[0] if isinstance(output, tuple) else output


    def _mask_arguments(self, hidden: torch.Tensor, padding_mask, position_ids):
        """The padding mask and positions to build the causal mask from: the same mask as from the batch's
        own, but without transformers' reads of device values where the host copies already answer them.

        transformers reads a device value per call (so per block and micro-batch here, once per forward in
        the model's own) to find whether positions restart (packed sequences; only without a padding mask)
        and whether a padding mask is all ones. A padding mask of all ones masks nothing (the mask from
        none); positions that never restart pack nothing (the mask from none, which the model's arange
        default gives too). Decided here from the host tensors the micro-batch was copied from; where
        there are none (given on the device), transformers decides as before."""
        if padding_mask is not None:
            on_host = side_input_on_host("attention_mask")
            if (_on_host(on_host) and on_host.dim() == 2 and on_host.shape[-1] == hidden.shape[1]
                    and bool(on_host.all())):
                padding_mask = None
            return padding_mask, None  # with a padding mask, transformers looks for no packed sequences
        if position_ids is None or not self._mask_reads_positions:
            return None, None
        on_host = side_input_on_host("position_ids")
        if _on_host(on_host) and not _restarts(on_host):
            return None, None
        return None, position_ids


def _on_host(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"


def _restarts(position_ids: torch.Tensor) -> bool:
    """Whether positions in a row of ``position_ids`` ever step by other than 1 (transformers'
    ``find_packed_sequence_indices`` finds packed sequences so; the first position may be anything)."""
    return bool((position_ids.diff(dim=-1) != 1).any())


class HeadHiddenStates(NamedTuple):
    """The head's output when it leaves the LM head to the loss (``HfHead.returns_hidden_states``): the
    final hidden states and the LM head module, whose parameters are fetched while the loss runs."""
    hidden_states: torch.Tensor
    lm_head: nn.Module


class HfHead(nn.Module):
    """The modules the stack applies after its blocks (final norm, output projection), then the LM head.
    With ``returns_hidden_states`` set, it returns ``HeadHiddenStates`` instead of the logits: for a loss
    that projects through the LM head itself in tiles (TRL's fused LM head), never holding the logits."""

    def __init__(self, chain: List[nn.Module], lm_head: nn.Module):
        super().__init__()
        self.chain = nn.ModuleList(chain)
        self.lm_head = lm_head
        self.returns_hidden_states = False

    def forward(self, hidden: torch.Tensor):
        for module in self.chain:
            hidden = module(hidden)
        if self.returns_hidden_states:
            return HeadHiddenStates(hidden, self.lm_head)
        return self.lm_head(hidden)

