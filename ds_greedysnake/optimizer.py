"""Adam over SSD-resident optimizer states, one layer at a time, split into global and per-layer parts.

Per layer, two SSD slots each hold [fp32 master | exp_avg | exp_avg_sq]; the fp32 gradient
accumulated over the step goes to the update through host memory shared with the worker
(``host_memory.py``) for the layers that fit ``gradient_host_memory_mb``, and through one SSD region
for the others. An update reads the committed slot and writes the other
one (and the layer's other parameter slot), so an update made before the step's global decision
(speculative, during backward) is committed by flipping the slot, or discarded by not flipping it:
a skipped step leaves every layer exactly as it was.

Front layers that are only updated after the decision may instead keep their states in one slot of
shared host memory (``optimizer_host_memory_mb``), updated in place: no state goes through SSD for
them, and the next forward, which waits for those updates first, waits less.

With the worker, the states the next step's updates read first are hinted after each step
(``announce_update_order``): the worker reads them while it has nothing else to do
(``optimizer_read_ahead_mb``, update_pipeline.py).

The global part of a step (gradient norm, non-finite skip, clip coefficient, learning rate and
step count) needs every layer's gradient and is decided once, in ``decide_step``.
"""
import copy
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from .checkpoint import LayerState
from .deepspeed_compat import AdamHyperparameters, CpuAdamKernel
from .host_memory import HostArena, SharedHostMemory
from .layer import LayerOwner
from .parallel import DataParallel
from .ssd import Region, SsdStore, padded_size
from .update_pipeline import STATE_PIECE_NUMEL, ReadAheadPiece, piece_ranges
from .updates import (BufferSizes, InlineUpdater, ReplayTask, UpdateHandle, Updater, UpdateTask, WorkerUpdater,
                      plan_write)

_KNOWN_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam"}


@dataclass
class StepDecision:
    """The global part of one optimizer step."""
    step: int                 # Adam's step count used by this update (1-based)
    clip_coefficient: float   # multiply gradients by this (1.0: no clipping)
    global_grad_norm: float
    skipped: bool             # a non-finite gradient somewhere: no layer is updated
    hyper: AdamHyperparameters


def adam_settings(ds_optimizer: Dict[str, Any]) -> Tuple[AdamHyperparameters, bool]:
    """Hyperparameters and AdamW mode from ds_config's "optimizer" block, as DeepSpeed reads it."""
    params = dict(ds_optimizer.get("params", {}))
    unknown = set(params) - _KNOWN_ADAM_PARAMS
    if unknown:
        raise ValueError(f"optimizer.params has keys greedysnake does not know: {sorted(unknown)}; "
                         f"known: {sorted(_KNOWN_ADAM_PARAMS)}")
    betas = params.get("betas", (0.9, 0.999))
    hyper = AdamHyperparameters(lr=float(params.get("lr", 1e-3)), beta1=float(betas[0]), beta2=float(betas[1]),
                                eps=float(params.get("eps", 1e-8)), weight_decay=float(params.get("weight_decay", 0.0)),
                                bias_correction=bool(params.get("bias_correction", True)))
    # DeepSpeed's "Adam" is decoupled-weight-decay AdamW unless adam_w_mode is false.
    adamw_mode = str(ds_optimizer.get("type")).lower() == "adamw" or bool(params.get("adam_w_mode", True))
    return hyper, adamw_mode


def squared_norm(values: torch.Tensor, row_width: int = 1024) -> float:
    """Sum of squares to fp32 precision (~1e-7 relative, as PyTorch's and DeepSpeed's fp32 norms), at
    memory speed: fp32 norms of short rows, summed in fp64. A flat fp32 norm of millions of elements
    was 1e-3 off here; converting everything to fp64 first took 10x longer."""
    flat = values.reshape(-1)
    whole = flat.numel() // row_width * row_width
    total = torch.linalg.vector_norm(flat[:whole].view(-1, row_width), dim=1).double().pow(2).sum()
    return float(total + flat[whole:].double().pow(2).sum())


class LayerwiseAdam(torch.optim.Optimizer):
    """A torch optimizer to lr schedulers (DeepSpeed's and PyTorch's): they set ``param_groups[0]["lr"]``,
    which each step's decision reads. Its one parameter is an empty placeholder: the real weights
    live on SSD and are updated layer by layer, never through ``step()``."""

    def __init__(self, layers: List[LayerOwner], store: SsdStore, ds_config: Dict[str, Any],
                 gradient_clipping: float, overlap: bool, worker_threads: int, parallel: DataParallel,
                 gradient_host_bytes: int, optimizer_host_bytes: int = 0, post_decision_layers: int = 0,
                 read_ahead_bytes: int = 0):
        hyper, adamw_mode = adam_settings(ds_config["optimizer"])
        defaults = {"lr": hyper.lr, "betas": (hyper.beta1, hyper.beta2), "eps": hyper.eps,
                    "weight_decay": hyper.weight_decay, "bias_correction": hyper.bias_correction}
        super().__init__([torch.nn.Parameter(torch.zeros(0))], defaults)
        self.gradient_clipping = gradient_clipping
        self.parallel = parallel
        self.step_count = 0
        self.skipped_steps = 0
        self._layers = layers
        self._store = store
        self._state_regions: Dict[int, List[Region]] = {}  # layers whose states are on SSD
        self._state_slot: List[int] = [0] * len(layers)
        self._grad_regions: Dict[int, Region] = {}  # layers whose gradient goes through SSD
        self._grad_sq_norms: List[Optional[float]] = [None] * len(layers)
        self._speculative: Dict[int, Tuple[UpdateHandle, int, int]] = {}
        self._next_task_id = 0
        shard_numels = [layer.shard_numel for layer in layers]
        # Only layers never updated speculatively may keep their states in one, in-place, host slot.
        self.host = SharedHostMemory(HostArena.for_gradients(shard_numels, gradient_host_bytes),
                                     HostArena.for_optimizer_states(shard_numels, post_decision_layers,
                                                                    optimizer_host_bytes))
        self._piece_numel = STATE_PIECE_NUMEL
        for layer in layers:
            if not self.host.optimizer_states.holds(layer.index):
                # Per slot, the pieces the update pipeline streams (update_pipeline.py).
                self._state_regions[layer.index] = [
                    [store.create_region(f"opt_l{layer.index}_s{slot}_p{piece}", 12 * (stop - start), "optimizer")
                     for piece, (start, stop) in enumerate(piece_ranges(layer.shard_numel, self._piece_numel))]
                    for slot in (0, 1)]
            if not self.host.gradients.holds(layer.index):
                self._grad_regions[layer.index] = store.create_region(f"grad_l{layer.index}", 4 * layer.shard_numel,
                                                                      "grad")
        # Staging for states and gradients that go through SSD: none when every layer has a host slot.
        sizes = BufferSizes(max(shard_numels),
                            min(self._piece_numel, max((shard_numels[index] for index in self._state_regions),
                                                       default=0)),
                            max((shard_numels[index] for index in self._grad_regions), default=0))
        # Spare piece buffers of the worker's read-ahead: what the budget holds, at most one per piece on SSD.
        ssd_pieces = sum(len(slots[0]) for slots in self._state_regions.values())
        piece_bytes = padded_size(12 * sizes.largest_ssd_state_piece_numel)
        self.read_ahead_pieces = min(ssd_pieces, read_ahead_bytes // piece_bytes) if overlap and ssd_pieces else 0
        self._state_buffer = (store.buffer(padded_size(12 * sizes.largest_ssd_state_piece_numel))
                              if sizes.largest_ssd_state_piece_numel else None)
        self._grad_buffer = (store.buffer(padded_size(4 * sizes.largest_ssd_grad_numel))
                             if sizes.largest_ssd_grad_numel else None)
        if overlap:
            self.updater: Updater = WorkerUpdater(store.counters, store.folder, store.ds_config, hyper, adamw_mode,
                                                  sizes._replace(read_ahead_pieces=self.read_ahead_pieces),
                                                  worker_threads, self.host)
        else:
            self.updater = InlineUpdater(store, CpuAdamKernel(hyper, adamw_mode), sizes, self.host)

    @property
    def needs_every_gradient_first(self) -> bool:
        """Clipping scales every layer by a global norm: no update may start before backward ends."""
        return self.gradient_clipping > 0

    def initialise_layer(self, layer: LayerOwner, master: torch.Tensor) -> None:
        """Write the fp32 master weights and zero moments of a layer before its first step."""
        zeros = torch.zeros_like(master)
        self._write_committed_states(layer, LayerState(master, zeros, zeros))

    def receive_gradient(self, layer: LayerOwner, grads: torch.Tensor) -> None:
        """Take this rank's shard of a layer's gradient for this step (once per step): into the layer's
        shared host slot, or to SSD."""
        on_host = self.host.gradients.holds(layer.index)
        if on_host:
            host_grads = self.host.gradients.slot(layer.index, layer.shard_numel)
        else:
            host_grads = self._grad_buffer[:4 * layer.shard_numel].view(torch.float32)
        host_grads.copy_(grads)
        self._grad_sq_norms[layer.index] = squared_norm(grads)
        if not on_host:
            self._store.write(self._grad_regions[layer.index], self._grad_buffer)

    def provisional_decision(self) -> StepDecision:
        """What the decision will be if every gradient turns out finite (valid without clipping)."""
        assert not self.needs_every_gradient_first
        return StepDecision(self.step_count + 1, 1.0, float("nan"), False, self._hyper())

    def decide_step(self) -> StepDecision:
        """The global part: needs every layer's gradient of this step; resolves speculative updates."""
        missing = [index for index, value in enumerate(self._grad_sq_norms) if value is None]
        assert not missing, f"layers {missing} handed no gradient this step"
        # Each rank holds a shard of every gradient: the squared norms add up over ranks.
        norm = math.sqrt(self.parallel.sum(sum(self._grad_sq_norms)))
        self._grad_sq_norms = [None] * len(self._layers)
        skipped = not math.isfinite(norm)
        coefficient = 1.0
        if self.gradient_clipping > 0 and not skipped:
            # DeepSpeed's rule: divide by (norm + 1e-6) / clip when that exceeds 1.
            ratio = (norm + 1e-6) / self.gradient_clipping
            coefficient = 1.0 / ratio if ratio > 1 else 1.0
        if skipped:
            self.skipped_steps += 1
        else:
            self.step_count += 1
        for layer_index, (handle, state_slot, param_slot) in self._speculative.items():
            if not skipped:
                self._commit(self._layers[layer_index], handle, state_slot, param_slot)
        self._speculative.clear()
        return StepDecision(self.step_count, coefficient, norm, skipped, self._hyper())

    def update_layer(self, layer: LayerOwner, decision: StepDecision, speculative: bool) -> None:
        """Submit the per-layer part: Adam on the committed slot, results into the other slots."""
        if decision.skipped:
            return
        if layer.index in self._state_regions:
            state_slot = 1 - self._state_slot[layer.index]
            state_in = self._state_regions[layer.index][self._state_slot[layer.index]]
            state_out = [plan_write(piece) for piece in self._state_regions[layer.index][state_slot]]
        else:
            # In host memory, updated in place: it could not be discarded.
            assert not speculative, f"layer {layer.index} keeps its states in host memory but was updated speculatively"
            state_slot, state_in, state_out = self._state_slot[layer.index], None, None
        param_slot = 1 - layer.param_slot
        self._next_task_id += 1
        task = UpdateTask(self._next_task_id, layer.index, layer.shard_numel, layer.compute_dtype,
                          state_in=state_in, state_out=state_out, piece_numel=self._piece_numel,
                          grad=self._grad_regions.get(layer.index),
                          param_out=plan_write(layer.param_regions[param_slot]),
                          step=decision.step, hyper=decision.hyper, clip_coefficient=decision.clip_coefficient)
        handle = self.updater.submit(task)
        if speculative:
            self._speculative[layer.index] = (handle, state_slot, param_slot)
        else:
            self._commit(layer, handle, state_slot, param_slot)

    def announce_update_order(self, layer_order: List[int]) -> None:
        """After a step: the layers the next step will update, in order. Their committed state pieces
        on SSD (final now: every update of this step is submitted and decided) are hinted to the
        worker, which reads them while it idles before the next backward's first gradient."""
        if not self.read_ahead_pieces:
            return
        pieces = [ReadAheadPiece(layer, index, copy.copy(region))
                  for layer in layer_order if layer in self._state_regions
                  for index, region in enumerate(self._state_regions[layer][self._state_slot[layer]])]
        self.updater.read_ahead(pieces[:self.read_ahead_pieces])

    def abandon_step(self) -> None:
        """A step failed before its decision: forget its gradients and discard its speculative updates."""
        self._grad_sq_norms = [None] * len(self._layers)
        self._speculative.clear()

    def flush(self) -> None:
        """Wait for every submitted update (before reading states or parameters from outside)."""
        self.updater.drain()

    def read_master(self, layer: LayerOwner) -> torch.Tensor:
        """A copy of a layer's fp32 master weights (for checks and exporting the model), without its moments:
        an export holds one layer's weights, not three times that."""
        self.flush()
        if layer.index not in self._state_regions:
            return self.host.optimizer_states.slot(layer.index, 3 * layer.shard_numel)[:layer.shard_numel].clone()
        master = torch.empty(layer.shard_numel, dtype=torch.float32)
        pieces = self._state_regions[layer.index][self._state_slot[layer.index]]
        for region, (start, stop) in zip(pieces, piece_ranges(layer.shard_numel, self._piece_numel)):
            self._store.read(region, self._state_buffer)
            master[start:stop].copy_(self._state_buffer[:4 * (stop - start)].view(torch.float32))
        return master

    def read_layer_state(self, layer: LayerOwner) -> LayerState:
        """Copies of a layer's committed fp32 master weights and Adam moments."""
        self.flush()
        if layer.index not in self._state_regions:
            states = self.host.optimizer_states.slot(layer.index, 3 * layer.shard_numel)
            return LayerState(*(part.clone() for part in states.split(layer.shard_numel)))
        parts = [torch.empty(layer.shard_numel, dtype=torch.float32) for _ in range(3)]
        pieces = self._state_regions[layer.index][self._state_slot[layer.index]]
        for region, (start, stop) in zip(pieces, piece_ranges(layer.shard_numel, self._piece_numel)):
            self._store.read(region, self._state_buffer)
            staged = self._state_buffer[:12 * (stop - start)].view(torch.float32).split(stop - start)
            for part, value in zip(parts, staged):
                part[start:stop].copy_(value)
        return LayerState(*parts)

    def restore_layer(self, layer: LayerOwner, state: LayerState, with_moments: bool) -> None:
        """Overwrite a layer's committed states (and its weights, their cast) from a checkpoint."""
        if not with_moments:
            current = self.read_layer_state(layer)
            state = LayerState(state.master, current.exp_avg, current.exp_avg_sq)
        self.flush()
        layer.wait_for_update()
        self._write_committed_states(layer, state)
        layer.overwrite_weights(state.master)

    def states_in_host_memory(self, layer: LayerOwner) -> bool:
        return layer.index not in self._state_regions

    def _write_committed_states(self, layer: LayerOwner, state: LayerState) -> None:
        """Into the layer's host slot, or piece by piece into its committed SSD slot."""
        values = (state.master, state.exp_avg, state.exp_avg_sq)
        if self.read_ahead_pieces:
            self.updater.cancel_read_ahead()  # no worker read of these states may be in flight or kept
        if layer.index not in self._state_regions:
            slot = self.host.optimizer_states.slot(layer.index, 3 * layer.shard_numel)
            for part, value in zip(slot.split(layer.shard_numel), values):
                part.copy_(value)
            return
        pieces = self._state_regions[layer.index][self._state_slot[layer.index]]
        for region, (start, stop) in zip(pieces, piece_ranges(layer.shard_numel, self._piece_numel)):
            staged = self._state_buffer[:12 * (stop - start)].view(torch.float32).split(stop - start)
            for part, value in zip(staged, values):
                part.copy_(value[start:stop])
            self._store.write(region, self._state_buffer)

    def counters_state(self) -> Dict[str, Any]:
        return {"step_count": self.step_count, "skipped_steps": self.skipped_steps,
                "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]}

    def load_counters_state(self, state: Dict[str, Any]) -> None:
        self.step_count, self.skipped_steps = state["step_count"], state["skipped_steps"]
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        self.flush()
        self.updater.replay(ReplayTask(self.step_count, self._hyper()))

    def close(self) -> None:
        self.updater.close()
        self.host.close()

    def _commit(self, layer: LayerOwner, handle: UpdateHandle, state_slot: int, param_slot: int) -> None:
        # Readers wait on the handle before they read the slots committed here.
        self._state_slot[layer.index] = state_slot
        layer.commit_update(param_slot, handle)

    def _hyper(self) -> AdamHyperparameters:
        group = self.param_groups[0]
        return AdamHyperparameters(lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1],
                                   eps=group["eps"], weight_decay=group["weight_decay"],
                                   bias_correction=group["bias_correction"])

    def step(self, closure=None):
        raise RuntimeError("the greedysnake optimizer steps inside engine.train_batch(); do not call step()")

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # gradients are accumulated and handed over by the layer owners
