"""Runs the schedule of one training step over the layer owners, the checkpoints and the optimizer."""
import time
from contextlib import nullcontext
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.profiler import record_function

from .activations import ActivationStore, InputGradients
from ..storage.io_trace import COMPUTE_OPS, TRAIN, IoEvent, IoRecorder
from .layer import LayerOwner
from ..models.micro_batch import first_layer_input, running_on, split_loss
from .optimizer import LayerwiseAdam, StepDecision
from .rng import RngState, capture_rng_state, replaying
from .schedule import (Op, OpKind, build_step_schedule, checkpoint_reads, evaluation_checkpoint_reads,
                       layers_updated_after_decision, lowest_trainable)

# (inputs, labels), already on the device; inputs: a tensor or a dict with side inputs (micro_batch.py)
MicroBatch = Tuple[Any, Any]


@dataclass
class StepResult:
    losses: List[float]
    decision: StepDecision
    seconds_by_op: Dict[str, float] = field(default_factory=dict)
    optimizer_seconds: float = 0.0
    optimizer_wait_seconds: float = 0.0
    # Per micro-batch, what loss_fn returned beside the loss (LossWithMetrics), on this rank.
    metrics: List[Dict[str, float]] = field(default_factory=list)


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
        # What loss_fn returned beside each micro-batch's loss this step (LossWithMetrics), by micro-batch.
        self._metrics: Dict[int, Dict[str, torch.Tensor]] = {}
        # Each op's span while an I/O trace is on (io_trace.py: where a step's time went).
        self.recorder = IoRecorder(TRAIN)
        # While a trace is on, off the CPU: each compute op's span with the timing events recorded on the
        # compute stream at its start and end, resolved into device seconds by ``resolve_device_times``.
        self._device_marks: List[Tuple[IoEvent, Any, Any]] = []

    def schedule(self, num_micro_batches: int) -> List[Op]:
        if num_micro_batches not in self._schedules:
            self._schedules[num_micro_batches] = build_step_schedule(
                len(self.layers), num_micro_batches, self.prefetch, self.overlap, self.deferred_layers,
                self.prefetch_depth, self._trainable)
        return self._schedules[num_micro_batches]

    def run_step(self, micro_batches: Sequence[MicroBatch]) -> StepResult:
        num_micro_batches = len(micro_batches)
        losses: Dict[int, torch.Tensor] = {}
        self._metrics = {}
        seconds: Dict[str, float] = defaultdict(float)
        # Spilled checkpoints are read from the SSD ahead of the executor, in the order it reads them.
        self.activations.expect_reads(checkpoint_reads(self.schedule(num_micro_batches)))
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
        read_losses, read_metrics = self._read_losses([losses[index] for index in range(num_micro_batches)],
                                                      [self._metrics.get(index, {}) for index in range(num_micro_batches)])
        return StepResult(read_losses, decision, dict(seconds), metrics=read_metrics)

    def _read_losses(self, losses: List[torch.Tensor], metrics: List[Dict[str, torch.Tensor]]):
        """Every micro-batch's loss and metrics as floats, in one read of the host (one wait for the
        device), not one each."""
        if not losses:
            return [], []
        names = sorted(metrics[0])
        if any(sorted(each) != names for each in metrics):
            raise ValueError(f"loss_fn returned metrics {[sorted(each) for each in metrics]} for the micro-batches of "
                             "one step: give every micro-batch the same metric names")
        values = [loss.float().reshape(()) for loss in losses]
        values += [each[name].float().reshape(()) for each in metrics for name in names]
        read = self.layers[0].transfers.read_values(torch.stack(values))
        count = len(losses)
        return read[:count], [dict(zip(names, read[count + index * len(names):count + (index + 1) * len(names)]))
                              for index in range(count)]

    def _run_schedule(self, micro_batches, losses, output_grads, seconds) -> StepDecision:
        decision: Optional[StepDecision] = None
        # Named ranges for torch.profiler traces, only while one records: each costs ~40 us otherwise.
        # The flag is torch-private: without it, always record (correct, just slower).
        profiling = getattr(torch.autograd.profiler, "_is_profiler_enabled", True)
        for op in self.schedule(len(micro_batches)):
            started, span_started = time.perf_counter(), time.monotonic()
            device_start = self._mark_compute(op)
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
                # Checkpoint copies that have run since: their SSD writes start; the next reads start.
                self.activations.poll()
            seconds[op.kind.value] += time.perf_counter() - started
            if self.recorder.enabled:
                span = self.recorder.span(op.kind.value, span_started, str(op))
                if device_start is not None:
                    self._device_marks.append((span, device_start, self._mark_compute(op)))
        return decision

    def _mark_compute(self, op: Op):
        """A timing event on the compute stream (no wait) at a compute op's start or end while a trace is on
        and the device is not the host: the host only queues the op's kernels, its own span times that."""
        if not self.recorder.enabled or op.kind.value not in COMPUTE_OPS:
            return None
        return self.layers[0].transfers.mark_compute()

    def resolve_device_times(self) -> None:
        """Each recorded compute span's device seconds (``IoEvent.device_seconds``): one wait of the host
        for the device, when the trace is read (``engine.stop_io_trace``), never during the steps."""
        marks, self._device_marks = self._device_marks, []
        seconds = self.layers[0].transfers.elapsed_seconds([(start, end) for _, start, end in marks])
        for (span, _, _), elapsed in zip(marks, seconds):
            span.device_seconds = elapsed

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[MicroBatch]) -> Tuple[List[float], List[Dict[str, float]]]:
        """Losses (and loss_fn's metrics) of a forward through every layer, vertically, with no gradient and no update.
        Each layer's fetch waits for its pending update, so the weights are the fully updated ones.
        Between layers the hidden states wait in the activation store (host memory, then SSD; the latest
        on the device), and the last layer's output goes straight into its loss: the device holds one
        micro-batch's logits, whatever the number of micro-batches."""
        last = len(self.layers) - 1
        losses, metrics = [], []
        self.activations.expect_reads(evaluation_checkpoint_reads(len(self.layers), len(micro_batches)))
        try:
            for layer in self.layers:
                layer.fetch()
                if self.prefetch and layer.index < last:
                    self.layers[layer.index + 1].prefetch()  # its read runs while this layer computes
                for index, (inputs, labels) in enumerate(micro_batches):
                    with running_on(inputs):
                        output = layer.module(first_layer_input(inputs) if layer.index == 0
                                              else self.activations.take(layer.index, index))
                        if layer.index == last:
                            loss, micro_batch_metrics = split_loss(self.loss_fn(output, labels))
                            losses.append(loss.detach())
                            metrics.append(micro_batch_metrics)
                    if layer.index < last:
                        self.activations.put(layer.index + 1, index, output)
                layer.release()
        except BaseException:
            self._abandon_step()
            raise
        self.activations.clear()
        return self._read_losses(losses, metrics)

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
        try:
            self.activations.clear()  # waits for the SSD transfers in flight
        except Exception:  # the original error is the one worth raising
            pass
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
            return first_layer_input(micro_batches[micro_batch][0])
        if keep:
            return self.activations.peek(layer.index, micro_batch)
        return self.activations.take(layer.index, micro_batch)

    @torch.no_grad()
    def _forward(self, layer: LayerOwner, micro_batch: int, micro_batches) -> None:
        recomputed = layer.index >= self.backward_to
        if recomputed:
            self._rng_states[(layer.index, micro_batch)] = capture_rng_state()
        with running_on(micro_batches[micro_batch][0]):
            hidden = layer.module(self._layer_input(layer, micro_batch, micro_batches, keep=recomputed))
        self.activations.put(layer.index + 1, micro_batch, hidden)

    def _recompute(self, layer: LayerOwner, micro_batch: int, micro_batches):
        layer_input = self._layer_input(layer, micro_batch, micro_batches, keep=False)
        if layer.index > self.backward_to:
            layer_input = layer_input.detach().requires_grad_(True)
        with torch.enable_grad(), replaying(self._rng_states.pop((layer.index, micro_batch), None)), \
                running_on(micro_batches[micro_batch][0]):
            return layer_input, layer.module(layer_input)

    def _loss_backward(self, layer, micro_batch, micro_batches, losses, output_grads) -> None:
        layer_input, output = self._recompute(layer, micro_batch, micro_batches)
        with torch.enable_grad(), running_on(micro_batches[micro_batch][0]):
            loss, self._metrics[micro_batch] = split_loss(self.loss_fn(output, micro_batches[micro_batch][1]))
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
