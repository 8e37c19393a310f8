"""Runs the schedule of one training step over the layer owners, the checkpoints and the optimizer."""
import time
from contextlib import nullcontext
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.profiler import record_function

from .activations import ActivationStore, InputGradients
from .io_trace import TRAIN, IoRecorder
from .layer import LayerOwner
from .optimizer import LayerwiseAdam, StepDecision
from .rng import RngState, capture_rng_state, replaying
from .schedule import Op, OpKind, build_step_schedule, layers_updated_after_decision, lowest_trainable

MicroBatch = Tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), already on the device


@dataclass
class StepResult:
    losses: List[float]
    decision: StepDecision
    seconds_by_op: Dict[str, float] = field(default_factory=dict)
    optimizer_seconds: float = 0.0
    optimizer_wait_seconds: float = 0.0


class Executor:

    def __init__(self, layers: List[LayerOwner], activations: ActivationStore, optimizer: LayerwiseAdam,
                 loss_fn: Callable, grad_accumulate_dtype: torch.dtype, prefetch: bool, overlap: bool,
                 deferred_layers: Optional[int], prefetch_depth: int = 1):
        self.layers = layers
        self.activations = activations
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.grad_accumulate_dtype = grad_accumulate_dtype
        self.prefetch = prefetch
        self.prefetch_depth = prefetch_depth
        self.overlap = overlap
        # Exactness under clipping: nothing may be updated before the global norm is known.
        self.deferred_layers = layers_updated_after_decision(len(layers), overlap, deferred_layers,
                                                             optimizer.needs_every_gradient_first)
        self._trainable = [layer.trainable for layer in layers]
        # Backward stops at the lowest trainable layer: the layers under it need no stored input, no
        # recompute and no input gradient.
        self.backward_to = lowest_trainable(self._trainable, len(layers))
        self._schedules: Dict[int, List[Op]] = {}
        # Between backward's layers, per micro-batch; the latest on the device, the others in host memory.
        self._input_grads = InputGradients(layers[0].device)
        # The random state each (layer, micro-batch) forward started from: its recompute replays it (dropout).
        self._rng_states: Dict[Tuple[int, int], RngState] = {}
        # Each op's span while an I/O trace is on (io_trace.py: where a step's time went).
        self.recorder = IoRecorder(TRAIN)

    def schedule(self, num_micro_batches: int) -> List[Op]:
        if num_micro_batches not in self._schedules:
            self._schedules[num_micro_batches] = build_step_schedule(
                len(self.layers), num_micro_batches, self.prefetch, self.overlap, self.deferred_layers,
                self.prefetch_depth, self._trainable)
        return self._schedules[num_micro_batches]

    def run_step(self, micro_batches: Sequence[MicroBatch]) -> StepResult:
        num_micro_batches = len(micro_batches)
        losses: Dict[int, torch.Tensor] = {}
        seconds: Dict[str, float] = defaultdict(float)
        try:
            decision = self._run_schedule(micro_batches, losses, self._input_grads, seconds)
        except BaseException:
            self._abandon_step()
            raise
        self.activations.clear()
        self._input_grads.clear()
        self._rng_states.clear()
        # The next step updates layers in this same order: its first state reads can start now.
        self.optimizer.announce_update_order([op.layer for op in self.schedule(num_micro_batches)
                                              if op.kind == OpKind.UPDATE])
        return StepResult(self._read_losses([losses[index] for index in range(num_micro_batches)]), decision,
                          dict(seconds))

    def _read_losses(self, losses: List[torch.Tensor]) -> List[float]:
        """Every micro-batch's loss as a float, in one read of the host (one wait for the device), not one each."""
        return self.layers[0].transfers.read_values(torch.stack([loss.float() for loss in losses])) if losses else []

    def _run_schedule(self, micro_batches, losses, output_grads, seconds) -> StepDecision:
        decision: Optional[StepDecision] = None
        # Named ranges for torch.profiler traces, only while one records: each costs ~40 us otherwise.
        # The flag is torch-private: without it, always record (correct, just slower).
        profiling = getattr(torch.autograd.profiler, "_is_profiler_enabled", True)
        for op in self.schedule(len(micro_batches)):
            started, span_started = time.perf_counter(), time.monotonic()
            with record_function(f"gs::{op}") if profiling else nullcontext():
                if op.kind == OpKind.DECIDE_STEP:
                    # Through step(): torch's lr schedulers wrap it to see that the optimizer stepped.
                    decision = self.optimizer.step()
                elif op.kind == OpKind.UPDATE:
                    # Before the decision an update is speculative: committed or discarded by it.
                    speculative = decision is None
                    chosen = self.optimizer.provisional_decision() if speculative else decision
                    self.optimizer.update_layer(self.layers[op.layer], chosen, speculative)
                else:
                    self._run(op, micro_batches, losses, output_grads)
                # Gradient copies that have run since: their updates go to the worker now, without a wait.
                self.optimizer.poll()
            seconds[op.kind.value] += time.perf_counter() - started
            if self.recorder.enabled:
                self.recorder.span(op.kind.value, span_started, str(op))
        return decision

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[MicroBatch]) -> List[float]:
        """Losses of a forward through every layer, vertically, with no gradient and no update.
        Each layer's fetch waits for its pending update, so the weights are the fully updated ones.
        Between layers the hidden states wait in the activation store (host memory, then SSD; the latest
        on the device), and the last layer's output goes straight into its loss: the device holds one
        micro-batch's logits, whatever the number of micro-batches."""
        last = len(self.layers) - 1
        losses = []
        try:
            for layer in self.layers:
                layer.fetch()
                if self.prefetch and layer.index < last:
                    self.layers[layer.index + 1].prefetch()  # its read runs while this layer computes
                for index, (inputs, labels) in enumerate(micro_batches):
                    output = layer.module(inputs if layer.index == 0 else self.activations.take(layer.index, index))
                    if layer.index == last:
                        losses.append(self.loss_fn(output, labels).detach())
                    else:
                        self.activations.put(layer.index + 1, index, output)
                layer.release()
        except BaseException:
            self._abandon_step()
            raise
        self.activations.clear()
        return self._read_losses(losses)

    def _abandon_step(self) -> None:
        """After a failure mid-step: no SSD read left in flight (an aio handle destroyed with pending
        reads aborts the process), no half-step state kept."""
        for layer in self.layers:
            try:
                layer.release()
            except Exception:  # the original error is the one worth raising
                pass
            layer.discard_grads()
        self.optimizer.abandon_step()
        self.activations.clear()
        self._input_grads.clear()
        self._rng_states.clear()

    def _run(self, op: Op, micro_batches, losses, output_grads) -> None:
        layer = self.layers[op.layer]
        if op.kind == OpKind.PREFETCH:
            layer.prefetch()
        elif op.kind == OpKind.FETCH:
            layer.fetch()
        elif op.kind == OpKind.RELEASE:
            layer.release()
        elif op.kind == OpKind.FORWARD:
            self._forward(layer, op.micro_batch, micro_batches)
        elif op.kind == OpKind.LOSS_BACKWARD:
            self._loss_backward(layer, op.micro_batch, micro_batches, losses, output_grads)
        elif op.kind == OpKind.BACKWARD:
            self._backward(layer, op.micro_batch, micro_batches, output_grads)
        elif op.kind == OpKind.FLUSH_GRADS:
            if layer.index > 0:
                # Handing the gradient over waits for this layer's backward on the device: the copy of the
                # layer backward fetches next starts first, so that it overlaps that compute.
                self.layers[layer.index - 1].stage()
            self.optimizer.receive_gradient(layer, layer.take_grads())
        else:
            raise AssertionError(f"unknown op {op}")

    def _layer_input(self, layer: LayerOwner, micro_batch: int, micro_batches, keep: bool) -> torch.Tensor:
        if layer.index == 0:
            return micro_batches[micro_batch][0]
        if keep:
            return self.activations.peek(layer.index, micro_batch)
        return self.activations.take(layer.index, micro_batch)

    @torch.no_grad()
    def _forward(self, layer: LayerOwner, micro_batch: int, micro_batches) -> None:
        recomputed = layer.index >= self.backward_to
        if recomputed:
            self._rng_states[(layer.index, micro_batch)] = capture_rng_state()
        hidden = layer.module(self._layer_input(layer, micro_batch, micro_batches, keep=recomputed))
        self.activations.put(layer.index + 1, micro_batch, hidden)

    def _recompute(self, layer: LayerOwner, micro_batch: int, micro_batches):
        layer_input = self._layer_input(layer, micro_batch, micro_batches, keep=False)
        if layer.index > self.backward_to:
            layer_input = layer_input.detach().requires_grad_(True)
        with torch.enable_grad(), replaying(self._rng_states.pop((layer.index, micro_batch), None)):
            return layer_input, layer.module(layer_input)

    def _loss_backward(self, layer, micro_batch, micro_batches, losses, output_grads) -> None:
        layer_input, output = self._recompute(layer, micro_batch, micro_batches)
        with torch.enable_grad():
            loss = self.loss_fn(output, micro_batches[micro_batch][1])
            # Gradient accumulation averages over the micro-batches, as DeepSpeed and PyTorch do.
            (loss / len(micro_batches)).backward()
        losses[micro_batch] = loss.detach()
        self._finish_backward(layer, micro_batch, layer_input, output_grads)

    def _backward(self, layer, micro_batch, micro_batches, output_grads) -> None:
        layer_input, output = self._recompute(layer, micro_batch, micro_batches)
        torch.autograd.backward(output, output_grads.take(micro_batch))
        self._finish_backward(layer, micro_batch, layer_input, output_grads)

    def _finish_backward(self, layer, micro_batch, layer_input, output_grads) -> None:
        layer.accumulate_grads(self.grad_accumulate_dtype)
        if layer.index > self.backward_to:
            output_grads.put(micro_batch, layer_input.grad)
