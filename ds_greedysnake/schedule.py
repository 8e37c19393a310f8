"""The vertical (snake) schedule of one training step, as plain data. No torch here.

Layers are numbered 0..L-1: layer 0 takes the micro-batch inputs (the embedding), layer L-1
produces what the loss takes (the head). Every micro-batch passes through a layer before the
next layer starts, and the micro-batch order reverses on alternate layers, so the micro-batch
that ends one layer starts the next and its activation never has to leave the device.

Forward runs layers 0..L-2 and stores each layer's input. The last layer is not run in the
forward sweep: each of its backward tasks runs its forward, the loss and its backward for one
micro-batch. Backward then walks down to layer 0, recomputing each layer from its stored input.

For L=4, M=3 the compute order, as (layer, micro-batch), is:
    forward : (0,0)(0,1)(0,2) (1,2)(1,1)(1,0) (2,0)(2,1)(2,2)
    backward: (3,2)(3,1)(3,0) (2,0)(2,1)(2,2) (1,2)(1,1)(1,0) (0,0)(0,1)(0,2)
"""
from dataclasses import dataclass
from enum import Enum
from typing import List, Optional


class OpKind(str, Enum):
    PREFETCH = "prefetch"        # start reading a layer's parameters from SSD, do not wait
    FETCH = "fetch"              # make a layer's parameters resident (waits for its prefetch)
    FORWARD = "forward"          # run one micro-batch through a layer, store its input
    BACKWARD = "backward"        # recompute one micro-batch of a layer and backpropagate
    LOSS_BACKWARD = "loss_backward"  # last layer: forward, loss and backward of one micro-batch
    FLUSH_GRADS = "flush_grads"  # hand the layer's gradient, accumulated over all M, to the optimizer
    RELEASE = "release"          # drop a layer's resident parameters
    OPTIMIZER_STEP = "optimizer_step"  # global norm/clip decision and every layer's Adam update


@dataclass(frozen=True)
class Op:
    kind: OpKind
    layer: Optional[int] = None
    micro_batch: Optional[int] = None

    def __str__(self) -> str:
        if self.layer is None:
            return self.kind.value
        if self.micro_batch is None:
            return f"{self.kind.value}[{self.layer}]"
        return f"{self.kind.value}[{self.layer},{self.micro_batch}]"


def micro_batch_order(layer: int, num_micro_batches: int) -> List[int]:
    """Ascending on even layers, descending on odd ones, in both sweeps."""
    ascending = list(range(num_micro_batches))
    return ascending if layer % 2 == 0 else ascending[::-1]


def build_step_schedule(num_layers: int, num_micro_batches: int, prefetch: bool = True) -> List[Op]:
    """Every operation of one training step, in the order the executor runs them."""
    if num_layers < 2:
        raise ValueError(f"num_layers must be at least 2 (an input layer and an output layer), got {num_layers}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be at least 1, got {num_micro_batches}")
    last = num_layers - 1
    ops: List[Op] = []

    def fetch(layer: int, next_layer: Optional[int]) -> None:
        ops.append(Op(OpKind.FETCH, layer))
        # The next read starts as soon as this layer is resident, so it overlaps this layer's compute.
        if prefetch and next_layer is not None:
            ops.append(Op(OpKind.PREFETCH, next_layer))

    if prefetch:
        ops.append(Op(OpKind.PREFETCH, 0))
    for layer in range(last):
        fetch(layer, layer + 1)
        ops.extend(Op(OpKind.FORWARD, layer, mb) for mb in micro_batch_order(layer, num_micro_batches))
        ops.append(Op(OpKind.RELEASE, layer))
    for layer in range(last, -1, -1):
        fetch(layer, layer - 1 if layer > 0 else None)
        kind = OpKind.LOSS_BACKWARD if layer == last else OpKind.BACKWARD
        ops.extend(Op(kind, layer, mb) for mb in micro_batch_order(layer, num_micro_batches))
        ops.append(Op(OpKind.FLUSH_GRADS, layer))
        ops.append(Op(OpKind.RELEASE, layer))
    ops.append(Op(OpKind.OPTIMIZER_STEP))
    return ops


def format_schedule(ops: List[Op]) -> str:
    return " ".join(str(op) for op in ops)


def parameter_reads_per_step(num_layers: int) -> int:
    """Layer reads one step makes: once per layer for forward (the last layer has none), once for backward."""
    return (num_layers - 1) + num_layers
