"""Model shapes the planner reasons about: per layer, parameter count, FLOPs and activation size.

No torch here: a shape is arithmetic on the GPT built by ``ds_greedysnake.models.gpt`` (pre-norm
blocks, MLP ratio 4, untied head), split as the engine splits it: [embedding, blocks..., head].
"""
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from .errors import PlannerError


@dataclass(frozen=True)
class LayerShape:
    """One layer as the engine owns it (embedding, one block, or the head with the loss)."""
    kind: str                   # "embedding", "block" or "head"
    params: int                 # parameter count
    swapped_params: int         # in tensors ZeRO-3 swaps to NVMe (matrices; vectors stay in host memory)
    forward_flops_per_token: float
    checkpointed: bool          # the baseline recomputes it in backward (blocks only)
    # Every parameter tensor's element count: ZeRO-3 keeps tensors at or under its persistence threshold
    # on the device for the whole run (device_memory.py).
    tensor_numels: Tuple[int, ...] = ()
    # Ranks each tensor is partitioned over (ZeRO-3 swaps and updates one rank's share of each): data_parallel.
    partition_ranks: int = 1


@dataclass(frozen=True)
class GPTShape:
    name: str
    num_blocks: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    mlp_ratio: int = 4
    notes: str = ""
    layers: List[LayerShape] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for key in ("num_blocks", "hidden", "heads", "vocab", "seq_len", "mlp_ratio"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise PlannerError(f"model {self.name}: {key} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise PlannerError(f"model {self.name}: hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        object.__setattr__(self, "layers", _gpt_layers(self))

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def activation_elements_per_token(self) -> int:
        """A layer boundary's activation (the checkpoint the engine keeps per layer input)."""
        return self.hidden


def _gpt_layers(shape: GPTShape) -> List[LayerShape]:
    h, v, s, r = shape.hidden, shape.vocab, shape.seq_len, shape.mlp_ratio
    matrices = 3 * h * h + h * h + 2 * r * h * h
    vectors = 2 * 2 * h + 3 * h + h + r * h + h  # two LayerNorms, the four biases
    # Per token: 2 FLOPs per matrix weight, plus attention scores and the weighted sum (causal: half of
    # 2 * 2 * s * h on average, but the kernels run the full square on CPU; counted whole).
    block_flops = 2 * matrices + 4 * s * h
    block_tensors = (h, h, 3 * h * h, 3 * h, h * h, h, h, h, r * h * h, r * h, r * h * h, h)
    assert sum(block_tensors) == matrices + vectors
    embedding = LayerShape("embedding", v * h + s * h, v * h, 0.0, False, (v * h, s * h))
    block = LayerShape("block", matrices + vectors, matrices, float(block_flops), True, block_tensors)
    head = LayerShape("head", 2 * h + v * h, v * h, float(2 * v * h), False, (h, h, v * h))
    return [embedding] + [block] * shape.num_blocks + [head]


def lora_numels(shape: "GPTShape", rank: int) -> List[Tuple[int, int]]:
    """(trainable, frozen) parameters per layer of a LoRA run of ``shape``: adapters of rank ``rank`` on every
    block matrix (qkv, proj, up, down: ``rank * (fan_in + fan_out)`` each), every base weight frozen; the
    embedding and the head hold no adapter."""
    if not isinstance(rank, int) or rank < 1:
        raise PlannerError(f"LoRA rank must be a positive integer, got {rank!r}")
    h, r = shape.hidden, shape.mlp_ratio
    adapters = rank * ((h + 3 * h) + (h + h) + (h + r * h) + (r * h + h))
    return [(adapters if layer.kind == "block" else 0, layer.params) for layer in shape.layers]


# The A/B benchmark's two configurations (scripts/bench/ab_bench/ab_bench.py) and the paper's models. The paper's
# shapes are GPT-3-style; its sequence length is not restated in our design notes: 2048 is assumed.
NAMED_SHAPES: Dict[str, GPTShape] = {
    shape.name: shape for shape in (
        GPTShape("gpt-small", num_blocks=4, hidden=512, heads=8, vocab=2048, seq_len=128,
                 notes="scripts/train.py's built-in small GPT"),
        GPTShape("ab-ssd-bound", num_blocks=8, hidden=512, heads=8, vocab=2048, seq_len=8,
                 notes="scripts/bench/ab_bench/ab_bench.py ssd_bound (micro-batch 1; since main f2b36b5)"),
        GPTShape("ab-compute-bound", num_blocks=2, hidden=512, heads=8, vocab=2048, seq_len=128,
                 notes="scripts/bench/ab_bench/ab_bench.py compute_bound (micro-batch 4)"),
        GPTShape("gpt-65b", num_blocks=80, hidden=8192, heads=64, vocab=50257, seq_len=2048,
                 notes="the paper's GPT-65B: 80 layers, hidden 8192 (sequence length 2048 assumed)"),
        GPTShape("gpt-175b", num_blocks=96, hidden=12288, heads=96, vocab=50257, seq_len=2048,
                 notes="GPT-3 175B: 96 layers, hidden 12288 (sequence length 2048 assumed)"),
    )
}

_LAYER_KEYS = {"blocks": "num_blocks", "layers": "num_blocks", "hidden": "hidden", "heads": "heads",
               "vocab": "vocab", "seq_len": "seq_len", "seq": "seq_len", "mlp_ratio": "mlp_ratio"}


def named_shape(name: str) -> GPTShape:
    try:
        return NAMED_SHAPES[name.lower()]
    except KeyError:
        raise PlannerError(f"unknown model {name!r}; known models: {', '.join(sorted(NAMED_SHAPES))} "
                           "(or describe one with --layers blocks=2,hidden=1024,heads=8,vocab=2048,seq_len=32)") from None


def parse_layers(description: str) -> GPTShape:
    """``blocks=2,hidden=1024,heads=8,vocab=2048,seq_len=32`` (every key required but mlp_ratio)."""
    values = {}
    for item in filter(None, (part.strip() for part in description.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in _LAYER_KEYS:
            raise PlannerError(f"--layers item {item!r} is not KEY=VALUE with KEY one of {sorted(set(_LAYER_KEYS))}")
        try:
            values[_LAYER_KEYS[key.strip()]] = int(value)
        except ValueError:
            raise PlannerError(f"--layers {key.strip()}={value!r} is not an integer") from None
    missing = [key for key in ("num_blocks", "hidden", "heads", "vocab", "seq_len") if key not in values]
    if missing:
        raise PlannerError(f"--layers {description!r} is missing {', '.join(missing)} "
                           "(example: blocks=2,hidden=1024,heads=8,vocab=2048,seq_len=32)")
    return GPTShape("custom", **values)
