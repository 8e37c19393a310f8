"""The schedule, checked exhaustively for small numbers of layers and micro-batches."""
import itertools

import pytest

from ds_greedysnake.runtime.schedule import (Op, OpKind, build_step_schedule, checkpoint_reads, default_deferred_layers,
                                             evaluation_checkpoint_reads, format_schedule, lowest_trainable,
                                             micro_batch_order, parameter_reads_per_step)

SIZES = list(itertools.product(range(2, 7), range(1, 6), [True, False]))


def compute_order(ops, kinds):
    return [(op.layer, op.micro_batch) for op in ops if op.kind in kinds]


def test_matches_the_design_example():
    ops = build_step_schedule(4, 3)
    assert compute_order(ops, {OpKind.FORWARD}) == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0), (2, 0), (2, 1),
                                                    (2, 2)]
    assert compute_order(ops, {OpKind.BACKWARD, OpKind.LOSS_BACKWARD}) == [
        (3, 2), (3, 1), (3, 0), (2, 0), (2, 1), (2, 2), (1, 2), (1, 1), (1, 0), (0, 0), (0, 1), (0, 2)]


@pytest.mark.parametrize("num_layers,num_micro_batches,prefetch", SIZES)
def test_every_micro_batch_passes_every_layer_once_in_snake_order(num_layers, num_micro_batches, prefetch):
    ops = build_step_schedule(num_layers, num_micro_batches, prefetch)
    forward = compute_order(ops, {OpKind.FORWARD})
    backward = compute_order(ops, {OpKind.BACKWARD, OpKind.LOSS_BACKWARD})
    everything = set(itertools.product(range(num_layers), range(num_micro_batches)))
    assert sorted(forward) == sorted(k for k in everything if k[0] < num_layers - 1)
    assert sorted(backward) == sorted(everything)
    # Vertical: all micro-batches of a layer before the next layer (forward up, backward down).
    assert [layer for layer, _ in forward] == sorted(layer for layer, _ in forward)
    assert [layer for layer, _ in backward] == sorted((layer for layer, _ in backward), reverse=True)
    # Snake: the micro-batch that ends a layer starts the next one, in both sweeps and across them.
    sweep = forward + backward
    for previous, current in zip(sweep, sweep[1:]):
        if previous[0] != current[0]:
            assert previous[1] == current[1], (previous, current)
    # Only the last layer turns forward into loss and backward.
    assert all((op.layer == num_layers - 1) == (op.kind == OpKind.LOSS_BACKWARD)
               for op in ops if op.kind in (OpKind.BACKWARD, OpKind.LOSS_BACKWARD))


RESIDENCY_SIZES = [(layers, mbs, prefetch, depth) for layers, mbs, prefetch in SIZES for depth in (1, 2, 3)
                   if prefetch or depth == 1]


@pytest.mark.parametrize("num_layers,num_micro_batches,prefetch,depth", RESIDENCY_SIZES)
def test_layers_are_resident_exactly_when_used(num_layers, num_micro_batches, prefetch, depth):
    """Replay the schedule against a residency model: compute only on fetched layers, one read per fetch,
    at most ``depth`` reads in flight and 1 + ``depth`` parameter buffers in use."""
    ops = build_step_schedule(num_layers, num_micro_batches, prefetch, prefetch_depth=depth)
    reads = _replay(ops, num_layers, num_micro_batches, depth, [True] * num_layers)
    assert reads == parameter_reads_per_step(num_layers) == 2 * num_layers - 2
    _check_prefetch(ops, prefetch, depth, num_layers)


FROZEN_SIZES = [(layers, trainable, prefetch, depth) for layers in range(2, 6)
                for trainable in itertools.product([False, True], repeat=layers) if any(trainable)
                for prefetch, depth in ((False, 1), (True, 1), (True, 2))]


@pytest.mark.parametrize("num_layers,trainable,prefetch,depth", FROZEN_SIZES)
def test_layers_with_nothing_to_train_get_no_flush_and_no_update(num_layers, trainable, prefetch, depth):
    """Every pattern of entirely frozen layers: the residency model holds, the trainable layers are flushed
    and updated once each, the others never, and backward stops at the lowest trainable layer."""
    ops = build_step_schedule(num_layers, 2, prefetch, overlap=True, deferred_layers=1, prefetch_depth=depth,
                              trainable=trainable)
    backward_to = trainable.index(True)
    reads = _replay(ops, num_layers, 2, depth, trainable)
    assert reads == parameter_reads_per_step(num_layers, backward_to)
    assert reads == 2 * num_layers - 2 - backward_to + (1 if backward_to == num_layers - 1 else 0)
    _check_prefetch(ops, prefetch, depth, num_layers)
    wanted = sorted(layer for layer in range(num_layers) if trainable[layer])
    for kind in (OpKind.FLUSH_GRADS, OpKind.UPDATE):
        assert sorted(op.layer for op in ops if op.kind == kind) == wanted
    assert {op.layer for op in ops if op.kind == OpKind.BACKWARD} == set(range(backward_to, num_layers - 1))


def _replay(ops, num_layers, num_micro_batches, depth, trainable):
    """Checks the schedule against a residency model; returns the parameter reads it makes."""
    resident, in_flight, reads = set(), set(), 0
    backward_done = {layer: 0 for layer in range(num_layers)}
    flushed = set()
    for op in ops:
        if op.kind == OpKind.PREFETCH:
            assert op.layer not in resident and op.layer not in in_flight
            in_flight.add(op.layer)
            reads += 1
        elif op.kind == OpKind.FETCH:
            if op.layer in in_flight:
                in_flight.remove(op.layer)
            elif op.layer not in resident:
                reads += 1
            resident.add(op.layer)
            # One layer resident at a time, but at the turn: layer L-2 stays for the backward sweep.
            assert len(resident) == 1 or resident == {num_layers - 2, num_layers - 1}, resident
        elif op.kind == OpKind.RELEASE:
            resident.remove(op.layer)
        elif op.kind in (OpKind.FORWARD, OpKind.BACKWARD, OpKind.LOSS_BACKWARD):
            assert op.layer in resident, op
            if op.kind != OpKind.FORWARD:
                backward_done[op.layer] += 1
        elif op.kind == OpKind.FLUSH_GRADS:
            assert backward_done[op.layer] == num_micro_batches and op.layer not in flushed
            flushed.add(op.layer)
        elif op.kind == OpKind.DECIDE_STEP:
            assert flushed == {layer for layer in range(num_layers) if trainable[layer]}
            assert not resident and not in_flight
        elif op.kind == OpKind.UPDATE:
            assert op.layer in flushed and op.layer not in resident
        # The parameter pool holds 1 + depth buffers: resident layers and reads in flight share them.
        assert len(in_flight) <= depth and len(resident) + len(in_flight) <= 1 + depth, (op, resident, in_flight)
    assert ops[-1].kind in (OpKind.DECIDE_STEP, OpKind.UPDATE)
    return reads


def _check_prefetch(ops, prefetch, depth, num_layers):
    if not prefetch:
        return
    # Every fetch but the very first finds its read already started.
    fetches = [i for i, op in enumerate(ops) if op.kind == OpKind.FETCH]
    for index in fetches:
        earlier = [op for op in ops[:index] if op.kind == OpKind.PREFETCH and op.layer == ops[index].layer]
        assert earlier
    # Each read starts as early as the pool allows: ``depth`` fetches ahead (or at the start).
    distinct_reads = sum(op.kind == OpKind.PREFETCH for op in ops)
    if depth < num_layers and distinct_reads > depth:
        assert max(len(in_flight_at) for in_flight_at in _reads_in_flight(ops)) == min(depth, num_layers - 1)


def _reads_in_flight(ops):
    """The set of layers being read after each op."""
    in_flight, history = set(), []
    for op in ops:
        if op.kind == OpKind.PREFETCH:
            in_flight.add(op.layer)
        elif op.kind == OpKind.FETCH:
            in_flight.discard(op.layer)
        history.append(set(in_flight))
    return history


def test_deeper_prefetch_reads_two_layers_ahead():
    text = format_schedule([op for op in build_step_schedule(4, 1, prefetch_depth=2)
                            if op.kind in (OpKind.PREFETCH, OpKind.FETCH, OpKind.RELEASE)])
    # Layer 2 (L-2) is kept across the turn, so backward's reads of 1 and 0 start at the head and at 2.
    assert text == ("prefetch[0] prefetch[1] fetch[0] prefetch[2] release[0] fetch[1] prefetch[3] release[1] fetch[2] "
                    "fetch[3] prefetch[1] release[3] fetch[2] prefetch[0] release[2] fetch[1] release[1] fetch[0] "
                    "release[0]")


def test_rejects_prefetch_depth_zero():
    with pytest.raises(ValueError, match="prefetch_depth must be at least 1, got 0"):
        build_step_schedule(4, 1, prefetch_depth=0)


OVERLAP_SIZES = [(layers, mbs, deferred) for layers in range(2, 7) for mbs in (1, 3)
                 for deferred in [None] + list(range(layers + 1))]


@pytest.mark.parametrize("num_layers,num_micro_batches,deferred", OVERLAP_SIZES)
def test_every_layer_updated_once_after_its_gradient(num_layers, num_micro_batches, deferred):
    ops = build_step_schedule(num_layers, num_micro_batches, overlap=True, deferred_layers=deferred)
    deferred = default_deferred_layers(num_layers) if deferred is None else deferred
    positions = {op: index for index, op in enumerate(ops)}
    decide = positions[Op(OpKind.DECIDE_STEP)]
    updates = [op.layer for op in ops if op.kind == OpKind.UPDATE]
    assert sorted(updates) == list(range(num_layers))
    for layer in range(num_layers):
        update = positions[Op(OpKind.UPDATE, layer)]
        assert update > positions[Op(OpKind.FLUSH_GRADS, layer)]
        # Speculative (before the decision) exactly for the layers not deferred.
        assert (update < decide) == (layer >= deferred)
        # A layer is never updated while resident: its release comes first.
        releases = [i for i, op in enumerate(ops) if op == Op(OpKind.RELEASE, layer)]
        assert releases[-1] < update
    # Deferred updates follow the decision front layer first: the next forward needs layer 0 first.
    assert updates[num_layers - deferred:] == list(range(deferred))


@pytest.mark.parametrize("num_layers", range(2, 7))
def test_without_overlap_every_update_follows_the_decision(num_layers):
    ops = build_step_schedule(num_layers, 2, overlap=False, deferred_layers=1)
    decide = ops.index(Op(OpKind.DECIDE_STEP))
    assert [op for op in ops[decide + 1:]] == [Op(OpKind.UPDATE, layer) for layer in range(num_layers)]
    assert all(op.kind != OpKind.UPDATE for op in ops[:decide])


def test_deferred_layers_out_of_range():
    with pytest.raises(ValueError, match="deferred_layers must be between 0 and the number of layers \\(3\\), got 4"):
        build_step_schedule(3, 2, overlap=True, deferred_layers=4)


def test_parameter_reads_do_not_depend_on_micro_batches():
    counts = {m: sum(op.kind == OpKind.FETCH for op in build_step_schedule(6, m)) for m in (1, 2, 8, 32)}
    assert len(set(counts.values())) == 1


def test_order_alternates():
    assert micro_batch_order(0, 3) == [0, 1, 2]
    assert micro_batch_order(1, 3) == [2, 1, 0]


def test_printable():
    text = format_schedule(build_step_schedule(2, 2))
    # Layer 0 (L-2) stays resident across the turn: no release after forward, no second read.
    assert text.startswith("prefetch[0] fetch[0] prefetch[1] forward[0,0] forward[0,1] fetch[1] loss_backward[1,1]")
    assert text.endswith("release[0] decide_step update[0] update[1]")


@pytest.mark.parametrize("num_layers,num_micro_batches", [(1, 2), (0, 1), (3, 0)])
def test_rejects_impossible_sizes(num_layers, num_micro_batches):
    with pytest.raises(ValueError, match="must be at least"):
        build_step_schedule(num_layers, num_micro_batches)


def test_checkpoint_reads_match_the_design_example():
    # Forward reads the inputs of layers 1 and 2 (kept), backward takes those of layers 3, 2 and 1.
    assert checkpoint_reads(build_step_schedule(4, 3)) == [
        (1, 2), (1, 1), (1, 0), (2, 0), (2, 1), (2, 2),
        (3, 2), (3, 1), (3, 0), (2, 0), (2, 1), (2, 2), (1, 2), (1, 1), (1, 0)]


@pytest.mark.parametrize("num_layers,num_micro_batches,trainable", [
    (layers, micro, trainable) for layers, micro in itertools.product(range(2, 7), range(1, 5))
    for trainable in [None] + [[index >= lowest for index in range(layers)] for lowest in range(1, layers)]])
def test_checkpoint_reads_are_the_executors(num_layers, num_micro_batches, trainable):
    """A layer input is read in forward (layers 1 .. L-2) and again in backward exactly when the layer is
    recomputed (l >= backward_to); the last layer's input only in backward; forward reads come first."""
    reads = checkpoint_reads(build_step_schedule(num_layers, num_micro_batches, trainable=trainable))
    backward_to = lowest_trainable(trainable, num_layers)
    for layer in range(1, num_layers):
        for micro_batch in range(num_micro_batches):
            recomputed = layer >= backward_to
            in_forward = layer < num_layers - 1
            assert reads.count((layer, micro_batch)) == int(in_forward) + int(recomputed)
    forward_reads = (num_layers - 2) * num_micro_batches
    assert [layer for layer, _ in reads[:forward_reads]] == sorted(layer for layer, _ in reads[:forward_reads])
    # The snake: the first read of each layer in forward is the micro-batch the layer below put last.
    for layer in range(1, num_layers - 1):
        first = next(key for key in reads if key[0] == layer)
        assert first == (layer, micro_batch_order(layer - 1, num_micro_batches)[-1])


def test_evaluation_reads_layer_by_layer_in_micro_batch_order():
    assert evaluation_checkpoint_reads(3, 2) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert evaluation_checkpoint_reads(2, 1) == [(1, 0)]
