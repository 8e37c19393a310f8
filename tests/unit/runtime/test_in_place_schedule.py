"""The layers the SSD layout updates in place (one slot) are never updated before the step's decision, so
a non-finite gradient is always found before any in-place update starts: checked on every schedule."""
import itertools

import pytest

from ds_greedysnake.runtime.schedule import OpKind, build_step_schedule, layers_updated_after_decision
from ds_greedysnake.storage.ssd_layout import LayoutSettings, plan_layout


@pytest.mark.parametrize("num_layers,num_micro_batches", list(itertools.product(range(2, 7), (1, 3))))
def test_in_place_layers_are_only_updated_after_the_decision(num_layers, num_micro_batches):
    for overlap, clipping, prefetch_depth in itertools.product((False, True), (False, True), (1, 2)):
        for deferred in [None] + list(range(num_layers + 1)):
            post_decision = layers_updated_after_decision(num_layers, overlap, deferred, clipping)
            layout = plan_layout([1000] * num_layers, LayoutSettings(2, 4, post_decision, 0, 0, 1 << 22))
            ops = build_step_schedule(num_layers, num_micro_batches, True, overlap, post_decision, prefetch_depth)
            decision = ops.index(next(op for op in ops if op.kind == OpKind.DECIDE_STEP))
            for position, op in enumerate(ops):
                if op.kind == OpKind.UPDATE and layout.layers[op.layer].in_place:
                    assert position > decision, (num_layers, overlap, clipping, deferred, op)
                if op.kind in (OpKind.PREFETCH, OpKind.FETCH) and position > decision:
                    raise AssertionError(f"a read after the decision would race the in-place updates: {op}")
            # A one-slot layer's gradient is written over its weights at its flush: nothing reads it after.
            # (A tied head fetches layer 0 with it, at the start of backward: before layer 0's flush, the last.)
            flushed = set()
            for op in ops:
                if op.kind == OpKind.FLUSH_GRADS:
                    flushed.add(op.layer)
                elif op.kind in (OpKind.PREFETCH, OpKind.FETCH):
                    assert op.layer not in flushed, (num_layers, overlap, deferred, prefetch_depth, op)
            assert [op.layer for op in ops if op.kind == OpKind.FLUSH_GRADS][-1] == 0
            # Every layer updated once per step; the speculative ones (two slots) before the decision.
            updated = [op.layer for op in ops if op.kind == OpKind.UPDATE]
            assert sorted(updated) == list(range(num_layers))
            assert all(ops.index(op) < decision for op in ops
                       if op.kind == OpKind.UPDATE and not layout.layers[op.layer].in_place)
