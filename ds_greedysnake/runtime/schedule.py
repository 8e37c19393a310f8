"""The vertical (snake) schedule of one training step, as plain data. No torch here.

Layers are numbered 0..L-1: layer 0 takes the micro-batch inputs (the embedding), layer L-1
produces what the loss takes (the head). Every micro-batch passes through a layer before the
next layer starts, and the micro-batch order reverses on alternate layers, so the micro-batch
that ends one layer starts the next and its activation never has to leave the device.

Forward runs layers 0..L-2 and stores each layer's input. The last layer is not run in the
forward sweep: each of its backward tasks runs its forward, the loss and its backward for one
micro-batch. Backward then walks down to layer 0, recomputing each layer from its stored input.
Layer L-2, the last of the forward sweep, stays resident across the turn to the backward sweep, so
the parameters are read 2L-2 times per step, whatever M (two layers resident at the turn).

Layers with nothing to train (every parameter frozen) get no gradient flush and no update; backward
still runs through them to reach the trainable layers below, and stops at the lowest trainable layer
(``backward_to``): layers under it are read once per step, by forward only.

For L=4, M=3 the compute order, as (layer, micro-batch), is:
    forward : (0,0)(0,1)(0,2) (1,2)(1,1)(1,0) (2,0)(2,1)(2,2)
    backward: (3,2)(3,1)(3,0) (2,0)(2,1)(2,2) (1,2)(1,1)(1,0) (0,0)(0,1)(0,2)
"""
from dataclasses import dataclass
from enum import Enum
from typing import List, Optional, Sequence, Tuple


class OpKind(str, Enum):
    PREFETCH = "prefetch"        # start reading a layer's parameters from SSD, do not wait
    FETCH = "fetch"              # make a layer's parameters resident (waits for its prefetch)
    FORWARD = "forward"          # run one micro-batch through a layer, store its input
    BACKWARD = "backward"        # recompute one micro-batch of a layer and backpropagate
    LOSS_BACKWARD = "loss_backward"  # last layer: forward, loss and backward of one micro-batch
    FLUSH_GRADS = "flush_grads"  # hand the layer's gradient, accumulated over all M, to the optimizer
    RELEASE = "release"          # drop a layer's resident parameters
    DECIDE_STEP = "decide_step"  # the global part of the optimizer step: norm, skip, clip, lr, step count
    UPDATE = "update"            # submit a layer's Adam update; before decide_step it is speculative


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


def fetch_order(num_layers: int, backward_to: int = 0) -> List[int]:
    """The layers in the order the step fetches them: 0 .. L-2 forward, then L-1 down to ``backward_to``
    backward (layer L-2's second fetch finds it still resident)."""
    last = num_layers - 1
    return list(range(last)) + list(range(last, backward_to - 1, -1))


def lowest_trainable(trainable: Optional[Sequence[bool]], num_layers: int) -> int:
    """Where backward stops: the lowest layer with something to train (every layer: 0)."""
    if trainable is None:
        return 0
    if len(trainable) != num_layers:
        raise ValueError(f"trainable has {len(trainable)} entries for {num_layers} layers")
    if not any(trainable):
        raise ValueError("no layer has a trainable parameter: there is nothing to train")
    return list(trainable).index(True)


def keeps_turn_layer(num_layers: int, backward_to: int) -> bool:
    """Layer L-2 stays resident from forward into backward when backward reaches it."""
    return backward_to <= num_layers - 2


def prefetch_targets(num_layers: int, prefetch_depth: int, backward_to: int = 0) -> List[Optional[int]]:
    """For each position of ``fetch_order``, the layer whose read starts right after that fetch: the one
    ``prefetch_depth`` fetches ahead, unless it is resident then (layer L-2 across the turn). So at
    most ``prefetch_depth`` reads are in flight, each started as early as that allows."""
    order, turn = fetch_order(num_layers, backward_to), num_layers - 2
    kept = keeps_turn_layer(num_layers, backward_to)

    def resident_at(position: int) -> set:
        # Layer L-2 is resident from its forward fetch (position L-2) to its backward (position L).
        return {order[position]} | ({turn} if kept and turn <= position <= turn + 2 else set())

    targets: List[Optional[int]] = []
    for position in range(len(order)):
        ahead = position + prefetch_depth
        target = order[ahead] if ahead < len(order) else None
        if target is not None and (target in resident_at(position) or target in order[position + 1:ahead]):
            target = None  # resident, or its read (from an earlier position of the window) is already started
        targets.append(target)
    return targets


def build_step_schedule(num_layers: int, num_micro_batches: int, prefetch: bool = True,
                        overlap: bool = False, deferred_layers: Optional[int] = None,
                        prefetch_depth: int = 1, trainable: Optional[Sequence[bool]] = None) -> List[Op]:
    """Every operation of one training step, in the order the executor runs them.

    With ``prefetch``, ``prefetch_depth`` parameter reads are kept in flight ahead of the layer
    computing (``prefetch_targets``): with 2, the SSD always has a read queued behind the one it is
    serving, which it needs to reach its rate on layer-sized reads (docs/ab_bench.md).

    Without overlap every layer's update follows the global decision at the end of backward. With
    overlap, layers ``deferred_layers`` .. L-1 are updated during backward, speculatively, right after
    their gradient is flushed (committed or discarded by the decision), and layers 0 .. deferred_layers-1
    after the decision; those updates run asynchronously into the next step's forward. Either way a
    layer's fetch waits for its pending update (the handle it holds): optimizer(l) before forward(l).

    ``trainable`` (one flag per layer, default all): a layer without trainable parameters gets no flush and
    no update, and backward stops at the lowest trainable layer.
    """
    if num_layers < 2:
        raise ValueError(f"num_layers must be at least 2 (an input layer and an output layer), got {num_layers}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be at least 1, got {num_micro_batches}")
    if deferred_layers is None:
        deferred_layers = num_layers if not overlap else default_deferred_layers(num_layers)
    if not 0 <= deferred_layers <= num_layers:
        raise ValueError(f"deferred_layers must be between 0 and the number of layers ({num_layers}), "
                         f"got {deferred_layers}")
    if not overlap:
        deferred_layers = num_layers
    if prefetch_depth < 1:
        raise ValueError(f"prefetch_depth must be at least 1, got {prefetch_depth}")
    last = num_layers - 1
    backward_to = lowest_trainable(trainable, num_layers)
    trains = list(trainable) if trainable is not None else [True] * num_layers
    ops: List[Op] = []
    targets = iter(prefetch_targets(num_layers, prefetch_depth, backward_to))

    def fetch(layer: int) -> None:
        ops.append(Op(OpKind.FETCH, layer))
        # The next read starts as soon as this layer is resident, so it overlaps this layer's compute.
        target = next(targets)
        if prefetch and target is not None:
            ops.append(Op(OpKind.PREFETCH, target))

    if prefetch:
        ops.extend(Op(OpKind.PREFETCH, layer)
                   for layer in dict.fromkeys(fetch_order(num_layers, backward_to)[:prefetch_depth]))
    for layer in range(last):
        fetch(layer)
        ops.extend(Op(OpKind.FORWARD, layer, mb) for mb in micro_batch_order(layer, num_micro_batches))
        if layer != last - 1 or not keeps_turn_layer(num_layers, backward_to):
            # The backward sweep needs layer L-2 right after the last layer: keep it rather than read it again.
            ops.append(Op(OpKind.RELEASE, layer))
    for layer in range(last, backward_to - 1, -1):
        fetch(layer)
        kind = OpKind.LOSS_BACKWARD if layer == last else OpKind.BACKWARD
        ops.extend(Op(kind, layer, mb) for mb in micro_batch_order(layer, num_micro_batches))
        if trains[layer]:
            ops.append(Op(OpKind.FLUSH_GRADS, layer))
        ops.append(Op(OpKind.RELEASE, layer))
        if trains[layer] and layer >= deferred_layers:
            ops.append(Op(OpKind.UPDATE, layer))
    ops.append(Op(OpKind.DECIDE_STEP))
    # Front layers first: the next forward needs layer 0 first.
    ops.extend(Op(OpKind.UPDATE, layer) for layer in range(deferred_layers) if trains[layer])
    return ops


def checkpoint_reads(ops: Sequence[Op]) -> List[Tuple[int, int]]:
    """The layer-input checkpoints a step reads, as (layer, micro-batch), in the order the executor reads them
    when it runs ``ops``: forward of layer l >= 1 reads (l, m) (kept for backward when layer l is recomputed,
    taken otherwise), loss_backward and backward of layer l >= 1 take (l, m); layer 0 reads the micro-batch's
    inputs. A key read twice is kept at its first read. The activation store reads spilled checkpoints from
    the SSD ahead of this order."""
    reading = (OpKind.FORWARD, OpKind.LOSS_BACKWARD, OpKind.BACKWARD)
    return [(op.layer, op.micro_batch) for op in ops if op.kind in reading and op.layer >= 1]


def evaluation_checkpoint_reads(num_layers: int, num_micro_batches: int) -> List[Tuple[int, int]]:
    """The checkpoints an evaluation (a forward through every layer, micro-batches in order) takes, in order:
    layer l >= 1 takes (l, m) for every m."""
    return [(layer, micro_batch) for layer in range(1, num_layers) for micro_batch in range(num_micro_batches)]


def layers_updated_after_decision(num_layers: int, overlap: bool, deferred_layers: Optional[int],
                                  every_gradient_first: bool) -> int:
    """How many front layers (0 .. k-1) are only ever updated after the step's decision, never
    speculatively: every layer without the overlap or when the decision needs every gradient first
    (clipping), else the deferred ones."""
    if not overlap or every_gradient_first:
        return num_layers
    return default_deferred_layers(num_layers) if deferred_layers is None else deferred_layers


def default_deferred_layers(num_layers: int) -> int:
    """A quarter of the layers, at least one (the reference defers a quarter of each layer's parameters)."""
    return max(1, round(0.25 * num_layers))


def format_schedule(ops: List[Op]) -> str:
    return " ".join(str(op) for op in ops)


def parameter_reads_per_step(num_layers: int, backward_to: int = 0) -> int:
    """Layer reads one step makes: once per layer for forward (the last layer has none), once for backward
    down to ``backward_to`` (layer L-2 has none: it stays resident across the turn)."""
    return len(fetch_order(num_layers, backward_to)) - (1 if keeps_turn_layer(num_layers, backward_to) else 0)
