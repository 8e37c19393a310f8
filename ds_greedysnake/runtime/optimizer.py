"""Adam over SSD-resident optimizer states, one layer at a time, split into global and per-layer parts.

Per layer, [fp32 master | exp_avg | exp_avg_sq] lives on SSD in one slot or two (``ssd_layout.py``); the
fp32 gradient accumulated over the step goes to the update through host memory shared with the worker
(``host_memory.py``) for the layers that fit ``gradient_host_memory_mb``, and through SSD for the others.

A layer updated before the step's global decision (speculatively, during backward: overlap on, clipping
off, layers from ``deferred_layers`` up) has two slots: its update reads the committed slot and writes the
other one (and the layer's other parameter slot), committed by flipping the slot, or discarded by not
flipping it. Every other layer is only updated after the decision, which has already found every
gradient finite (a skipped step submits no update at all), so its one slot is updated in place: nothing
ever needs discarding. A skipped step therefore leaves every layer exactly as it was. Every reader of an
in-place slot waits for the update first: the layer's fetch waits on its handle, checkpoint reads flush,
and the worker reads states ahead only while no update is queued or in flight (``update_pipeline.py``).
The gradient of a one-slot layer goes into its parameter file (``ssd_layout.py``); after a skipped step
its weights are rewritten from the unchanged master (``_submit_recast``).

Front layers that are only updated after the decision may instead keep their states in one slot of
shared host memory (``optimizer_host_memory_mb``), updated in place: no state goes through SSD for
them, and the next forward, which waits for those updates first, waits less.

With the worker, the states the next step's updates read first are hinted after each step
(``announce_update_order``): the worker reads them while it has nothing else to do
(``optimizer_read_ahead_mb``, update_pipeline.py).

Frozen parameters have no state, gradient or update here: a layer's frozen ones live in a read-only region
of the layer (layer.py), and a layer with nothing to train (``trainable`` false) is never handed to
``receive_gradient`` or ``update_layer`` (the schedule has no flush or update for it); the gradient norm
and clipping are over the trainable parameters, as in PyTorch and DeepSpeed.

The global part of a step (gradient norm, non-finite skip, clip coefficient, learning rate and
step count) needs every layer's gradient and is decided once, in ``decide_step``.
"""
import copy
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
from deepspeed.utils import log_dist

from ..storage.checkpoint import LayerState
from ..deepspeed_compat import AdamHyperparameters, AioSettings, CpuAdamKernel
from ..storage.host_memory import HostArena, SharedHostMemory
from .layer import LayerOwner, Residency
from .parallel import DataParallel
from .schedule import layers_updated_after_decision
from ..settings import OptimizerBlock, Settings
from ..storage.ssd import Region, SsdStore, padded_size
from ..storage.ssd_layout import LayoutSettings, SsdLayout, check_free_space, describe, plan_layout
from ..storage.transfers import Guard
from ..optim.update_pipeline import STATE_PIECE_NUMEL, ReadAheadPiece, piece_ranges
from ..optim.updates import (BufferSizes, InlineUpdater, ReplayTask, UpdateHandle, Updater, UpdateTask, WorkerUpdater,
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


@dataclass(frozen=True)
class OptimizerSettings:
    """What LayerwiseAdam takes from the settings (``from_settings``)."""
    optimizer: OptimizerBlock      # Adam's hyperparameters
    aio: AioSettings               # the worker's I/O
    gradient_clipping: float       # 0: off
    overlap: bool                  # greedysnake.optimizer_overlap: updates in a worker process
    worker_threads: int
    gradient_host_bytes: int       # greedysnake.gradient_host_memory_mb
    optimizer_host_bytes: int      # greedysnake.optimizer_host_memory_mb
    post_decision_layers: int      # layers 0 .. k-1 are only updated after the step's decision
    read_ahead_bytes: int          # greedysnake.optimizer_read_ahead_mb
    compute_dtype: torch.dtype     # of the weights on SSD
    gradient_dtype: torch.dtype    # of the accumulated gradient (fp32, or bf16 under bf16 accumulation)
    ranks_sharing_disk: int = 1    # this machine's ranks, each with a swap folder on the same nvme_path

    @classmethod
    def from_settings(cls, settings: Settings, gradient_clipping: float, compute_dtype: torch.dtype,
                      gradient_dtype: torch.dtype, num_layers: int, worker_threads: int) -> "OptimizerSettings":
        """``gradient_clipping``: DeepSpeed's engine's (``engine.gradient_clipping()``); ``worker_threads``:
        config.worker_threads_for(config, device type), the field's default resolved."""
        config = settings.greedysnake
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        return cls(settings.optimizer, settings.aio, gradient_clipping, config.optimizer_overlap, worker_threads,
                   int(config.gradient_host_memory_mb * 2**20), int(config.optimizer_host_memory_mb * 2**20),
                   layers_updated_after_decision(num_layers, config.optimizer_overlap, config.deferred_layers,
                                                 gradient_clipping > 0),
                   int(config.optimizer_read_ahead_mb * 2**20), compute_dtype, gradient_dtype, max(1, local_ranks))

    def layout_settings(self) -> LayoutSettings:
        return LayoutSettings(_element_bytes(self.compute_dtype), _element_bytes(self.gradient_dtype),
                              self.post_decision_layers, self.gradient_host_bytes, self.optimizer_host_bytes,
                              STATE_PIECE_NUMEL)


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def adam_settings(block: OptimizerBlock) -> Tuple[AdamHyperparameters, bool]:
    """Hyperparameters and AdamW mode from ds_config's "optimizer" block, as DeepSpeed reads it."""
    params = block.params_dict()
    unknown = set(params) - _KNOWN_ADAM_PARAMS
    if unknown:
        raise ValueError(f"optimizer.params has keys greedysnake does not know: {sorted(unknown)}; "
                         f"known: {sorted(_KNOWN_ADAM_PARAMS)}")
    betas = params.get("betas", (0.9, 0.999))
    hyper = AdamHyperparameters(lr=float(params.get("lr", 1e-3)), beta1=float(betas[0]), beta2=float(betas[1]),
                                eps=float(params.get("eps", 1e-8)), weight_decay=float(params.get("weight_decay", 0.0)),
                                bias_correction=bool(params.get("bias_correction", True)))
    # DeepSpeed's "Adam" is decoupled-weight-decay AdamW unless adam_w_mode is false.
    adamw_mode = str(block.type).lower() == "adamw" or bool(params.get("adam_w_mode", True))
    return hyper, adamw_mode


def squared_norm(values: torch.Tensor, row_width: int = 1024) -> float:
    """``squared_norm_tensor`` read back as a float (a wait for the device where ``values`` lives there)."""
    return float(squared_norm_tensor(values, row_width))


def squared_norm_tensor(values: torch.Tensor, row_width: int = 1024) -> torch.Tensor:
    """Sum of squares to fp32 precision (~1e-7 relative, as PyTorch's and DeepSpeed's fp32 norms), at
    memory speed: fp32 norms of short rows, summed in fp64; an fp64 scalar where ``values`` lives, so that
    the device computes it with no wait of the host. A flat fp32 norm of millions of elements was 1e-3 off
    here; converting everything to fp64 first took 10x longer."""
    flat = values.reshape(-1)
    whole = flat.numel() // row_width * row_width
    total = torch.linalg.vector_norm(flat[:whole].view(-1, row_width), dim=1).double().pow(2).sum()
    return total + flat[whole:].double().pow(2).sum()


@dataclass
class _HandOver:
    """A layer's gradient on its way to host memory: its copy enqueued, not yet waited for."""
    layer: LayerOwner
    copied: Guard
    staging: Optional[torch.Tensor]  # for a gradient through SSD: the buffer it is written from once copied


class LayerwiseAdam(torch.optim.Optimizer):
    """A torch optimizer to lr schedulers (DeepSpeed's and PyTorch's): they set ``param_groups[0]["lr"]``,
    which each step's decision reads. Its one parameter is an empty placeholder: the real weights
    live on SSD and are updated layer by layer, never through ``step()``."""

    def __init__(self, layers: List[LayerOwner], store: SsdStore, settings: OptimizerSettings,
                 parallel: DataParallel):
        hyper, adamw_mode = adam_settings(settings.optimizer)
        defaults = {"lr": hyper.lr, "betas": (hyper.beta1, hyper.beta2), "eps": hyper.eps,
                    "weight_decay": hyper.weight_decay, "bias_correction": hyper.bias_correction}
        super().__init__([torch.nn.Parameter(torch.zeros(0))], defaults)
        self.gradient_clipping = settings.gradient_clipping
        self.worker_threads = settings.worker_threads  # the optimizer worker's CPU threads (Adam's, overlapped)
        self.parallel = parallel
        self.step_count = 0
        self.skipped_steps = 0
        self._layers = layers
        self._store = store
        self._gradient_dtype = settings.gradient_dtype
        self._piece_numel = STATE_PIECE_NUMEL
        shard_numels = [layer.shard_numel for layer in layers]
        self.layout: SsdLayout = plan_layout(shard_numels, settings.layout_settings(),
                                             [layer.frozen_layout.shard_numel for layer in layers])
        # Before any file exists: the disk must hold all of it (the activation spill is checked when its
        # size is known, activations.py).
        self.ssd_bytes = self.layout.bytes_by_kind()
        self._check_disk(settings)
        self._state_regions: Dict[int, List[List[Region]]] = {}  # layers whose states are on SSD: slots of pieces
        self._state_slot: List[int] = [0] * len(layers)
        self._grad_regions: Dict[int, Region] = {}  # layers whose gradient goes through SSD
        # Each layer's squared gradient norm of this step, where the gradient is (read once, at the decision).
        self._grad_sq_norms: List[Optional[Union[float, torch.Tensor]]] = self._no_norms()
        self._hand_overs: Dict[int, _HandOver] = {}  # gradients copied out, not yet waited for
        # Updates whose gradient is still on its way to host memory: submitted, in order, once its copy is seen
        # done (``poll``), or at the decision (layer, decision, speculative).
        self._waiting_updates: List[Tuple[LayerOwner, StepDecision, bool]] = []
        self._speculative: Dict[int, Tuple[UpdateHandle, int, int]] = {}
        self._gradient_over_weights: Set[int] = set()  # one-slot layers whose file holds this step's gradient
        self._next_task_id = 0
        # Only layers never updated speculatively may keep their states in one, in-place, host slot.
        self.host = SharedHostMemory(HostArena.for_gradients(shard_numels, settings.gradient_host_bytes),
                                     HostArena.for_optimizer_states(shard_numels, settings.post_decision_layers,
                                                                    settings.optimizer_host_bytes))
        try:
            self._create_regions()
            self.updater = self._start_updater(settings, hyper, adamw_mode)
        except BaseException:
            self.host.close()  # a caught failure (no space for a region, the worker not starting) leaks no memfd
            raise

    def _create_regions(self) -> None:
        """Every SSD region of the optimizer's layers: state pieces per slot, and gradients through SSD."""
        for layer, placed in zip(self._layers, self.layout.layers):
            if not placed.trainable:
                continue  # nothing but its frozen region, which the layer owns
            assert (placed.state_slots == 0) == self.host.optimizer_states.holds(layer.index), layer.index
            assert placed.gradient_on_ssd != self.host.gradients.holds(layer.index), layer.index
            if placed.state_slots:
                # Per slot, the pieces the update pipeline streams (update_pipeline.py).
                self._state_regions[layer.index] = [
                    [self._store.create_region(f"opt_l{layer.index}_s{slot}_p{piece}", 12 * (stop - start),
                                               "optimizer")
                     for piece, (start, stop) in enumerate(piece_ranges(layer.shard_numel, self._piece_numel))]
                    for slot in range(placed.state_slots)]
            if placed.gradient_on_ssd and not placed.gradient_in_parameter_file:
                self._grad_regions[layer.index] = self._store.create_region(f"grad_l{layer.index}",
                                                                            placed.gradient_bytes, "grad")
            # A gradient in the parameter file gets its region once that file exists (initialise_layer).

    def _start_updater(self, settings: OptimizerSettings, hyper: AdamHyperparameters, adamw_mode: bool) -> Updater:
        """The staging buffers for what goes through SSD, and where updates run: the worker (overlap) or inline."""
        store = self._store
        shard_numels = [layer.shard_numel for layer in self._layers]
        # Staging for states and gradients that go through SSD: none when every layer has a host slot.
        ssd_gradient_numels = [placed.numel for placed in self.layout.layers if placed.gradient_on_ssd]
        sizes = BufferSizes(max(shard_numels),
                            min(self._piece_numel, max((shard_numels[index] for index in self._state_regions),
                                                       default=0)),
                            max(ssd_gradient_numels, default=0))
        # Spare piece buffers of the worker's read-ahead: what the budget holds, at most one per piece on SSD.
        ssd_pieces = sum(len(slots[0]) for slots in self._state_regions.values())
        piece_bytes = padded_size(12 * sizes.largest_ssd_state_piece_numel)
        self.read_ahead_pieces = (min(ssd_pieces, settings.read_ahead_bytes // piece_bytes)
                                  if settings.overlap and ssd_pieces else 0)
        self._state_buffer = (store.buffer(padded_size(12 * sizes.largest_ssd_state_piece_numel))
                              if sizes.largest_ssd_state_piece_numel else None)
        # Staging for gradients through SSD; off the CPU two, so that a layer's gradient copy does not wait on the
        # host for the one before it (on the CPU accelerator a copy is done when it returns).
        staging = 1 if self._layers[0].transfers.device_is_host else 2
        self._grad_buffers = [store.buffer(padded_size(4 * sizes.largest_ssd_grad_numel))
                              for _ in range(staging if sizes.largest_ssd_grad_numel else 0)]
        if settings.overlap:
            return WorkerUpdater(store.counters, store.folder, store.aio, hyper, adamw_mode,
                                 sizes._replace(read_ahead_pieces=self.read_ahead_pieces), settings.worker_threads,
                                 self.host)
        return InlineUpdater(store, CpuAdamKernel(hyper, adamw_mode), sizes, self.host)

    def _check_disk(self, settings: OptimizerSettings) -> None:
        """Log the SSD bytes per kind and fail, naming the bytes needed and free, when the disk cannot hold them."""
        num_params = sum(layer.numel + layer.frozen_numel for layer in self._layers)
        ranks = settings.ranks_sharing_disk
        for_ranks = f" for each of {ranks} ranks on this machine" if ranks > 1 else ""
        in_place = sum(1 for placed in self.layout.layers if placed.in_place)
        frozen = sum(1 for placed in self.layout.layers if not placed.trainable)
        speculative = len(self._layers) - in_place - frozen
        frozen_note = f", {frozen} entirely frozen (never updated)" if frozen else ""
        log_dist(f"greedysnake SSD space{for_ranks}: {describe(self.ssd_bytes, num_params, activation_known=False)}; "
                 f"{in_place} of {len(self._layers)} layers updated in place (one slot), {speculative} "
                 f"speculatively (two slots){frozen_note}; under {self._store.folder}", ranks=[0])
        kinds = ", ".join(f"{kind} {value:,}" for kind, value in self.ssd_bytes.items() if value)
        check_free_space(sum(self.ssd_bytes.values()) * ranks, self._store.folder,
                         f"parameters, optimizer states and gradients ({kinds} bytes){for_ranks}")

    @property
    def needs_every_gradient_first(self) -> bool:
        """Clipping scales every layer by a global norm: no update may start before backward ends."""
        return self.gradient_clipping > 0

    def initialise_layer(self, layer: LayerOwner, master: torch.Tensor) -> None:
        """Write the fp32 master weights and zero moments of a layer before its first step (after
        ``layer.offload``, whose file a one-slot layer's gradient shares)."""
        if not layer.trainable:
            return
        if self.layout.layers[layer.index].gradient_in_parameter_file:
            self._grad_regions[layer.index] = layer.gradient_region(self.layout.layers[layer.index].gradient_bytes)
        zeros = torch.zeros_like(master)
        self._write_committed_states(layer, LayerState(master, zeros, zeros))

    def receive_gradient(self, layer: LayerOwner, grads: torch.Tensor) -> None:
        """Take this rank's shard of a layer's gradient for this step (once per step): into the layer's
        shared host slot, or to SSD.

        Off the CPU accelerator the copy goes on a transfer stream into registered memory and its squared
        norm is taken on the device; neither is waited for here, which would idle the device while the host
        enqueues the next layer. The copy is completed (and an SSD gradient written) once ``poll`` sees it
        done, between two ops of the schedule; the host waits for it only at the step's decision, or when
        an SSD gradient finds both staging buffers in use."""
        staging = None
        if self.host.gradients.holds(layer.index):
            host_grads = self.host.gradients.slot(layer.index, layer.shard_numel)
        else:
            # On SSD in the accumulation dtype: under bf16 accumulation the update's fp32 cast of it is exact.
            staging = self._free_staging_buffer()
            host_grads = staging[:self.layout.layers[layer.index].gradient_bytes].view(self._gradient_dtype)
        copied = layer.transfers.to_host(grads, host_grads)
        self._grad_sq_norms[layer.index] = squared_norm_tensor(grads)
        self._hand_overs[layer.index] = _HandOver(layer, copied, staging)

    def _free_staging_buffer(self) -> torch.Tensor:
        """A staging buffer no gradient copy in flight writes into; when both are, the older copy is waited for
        and its gradient written to SSD."""
        held = [hand_over.staging for hand_over in self._hand_overs.values() if hand_over.staging is not None]
        free = [buffer for buffer in self._grad_buffers if all(buffer is not other for other in held)]
        if free:
            return free[0]
        oldest = next(index for index, hand_over in self._hand_overs.items() if hand_over.staging is not None)
        buffer = self._hand_overs[oldest].staging
        self._complete_hand_over(oldest)
        return buffer

    def poll(self) -> None:
        """Between two ops: complete the hand-overs whose copy has run (no wait), then submit the updates
        waiting for them, in order."""
        self._complete_hand_overs(done_only=True)
        while self._waiting_updates and self._waiting_updates[0][0].index not in self._hand_overs:
            self._submit_update(*self._waiting_updates.pop(0))

    def _complete_hand_overs(self, done_only: bool = False) -> None:
        """Complete the gradient copies handed over (only those whose copy has run, ``done_only``) and write the
        SSD ones. Newest first when waiting: the copies run in order on one stream, so once the newest ran,
        the older ones are seen done; the SSD writes then go oldest first."""
        ready = [index for index in reversed(list(self._hand_overs))
                 if not done_only or self._hand_overs[index].copied.done()]
        if ready and not done_only:
            self._hand_overs[ready[0]].copied.wait()
        for index in reversed(ready):
            self._complete_hand_over(index)

    def _complete_hand_over(self, index: int) -> None:
        hand_over = self._hand_overs.pop(index)
        hand_over.copied.wait()
        if hand_over.staging is not None:
            if self.layout.layers[index].gradient_in_parameter_file:
                # Over the layer's weights on SSD: read by nobody until its update (or a recast) writes new
                # ones, since this step reads the layer no more (its backward is done).
                hand_over.layer.weights_hold_gradient = True
                self._gradient_over_weights.add(index)
            self._store.write(self._grad_regions[index], hand_over.staging)

    def provisional_decision(self) -> StepDecision:
        """What the decision will be if every gradient turns out finite (valid without clipping)."""
        assert not self.needs_every_gradient_first
        return StepDecision(self.step_count + 1, 1.0, float("nan"), False, self._hyper())

    def decide_step(self) -> StepDecision:
        """The global part: needs every layer's gradient of this step; resolves speculative updates."""
        missing = [index for index, value in enumerate(self._grad_sq_norms) if value is None]
        assert not missing, f"layers {missing} handed no gradient this step"
        self._complete_hand_overs()
        while self._waiting_updates:  # speculative: submitted now, committed or discarded below
            self._submit_update(*self._waiting_updates.pop(0))
        # Each rank holds a shard of every gradient: the squared norms add up over ranks (in layer order).
        norm = math.sqrt(self.parallel.sum(sum(self._read_norms())))
        self._grad_sq_norms = self._no_norms()
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
        """Submit the per-layer part: Adam on the committed slot, results into the other slots (or in place).
        An update whose gradient copy has not run yet waits for ``poll`` (or the decision) to be submitted,
        behind any waiting before it: the host does not wait for the device here."""
        if self._waiting_updates or layer.index in self._hand_overs:
            self._waiting_updates.append((layer, decision, speculative))  # the executor polls after this op
            return
        self._submit_update(layer, decision, speculative)

    def _submit_update(self, layer: LayerOwner, decision: StepDecision, speculative: bool) -> None:
        assert layer.index not in self._hand_overs, f"layer {layer.index}'s update submitted before its gradient"
        if layer.in_place:
            # In place, no going back: only after the decision (which has checked every gradient for
            # non-finite values first), and with no read of the layer in flight.
            assert not speculative, f"layer {layer.index} is updated in place but was updated speculatively"
            assert layer.state == Residency.ON_SSD, f"layer {layer.index} updated in place while {layer.state.value}"
        if decision.skipped:
            if layer.index in self._gradient_over_weights:
                self._submit_recast(layer)
            return
        state_slot, state_in, state_out = self._state_slot[layer.index], None, None
        if layer.index in self._state_regions:
            slots = self._state_regions[layer.index]
            committed, state_slot = state_slot, (state_slot + 1) % len(slots)
            # Copies taken before plan_write moves an in-place slot's generation: they name the data read.
            state_in = [copy.copy(piece) for piece in slots[committed]]
            state_out = [plan_write(piece) for piece in slots[state_slot]]
        else:
            # In host memory, updated in place: it could not be discarded.
            assert not speculative, f"layer {layer.index} keeps its states in host memory but was updated speculatively"
        param_slot = layer.next_param_slot
        self._next_task_id += 1
        grad = self._grad_regions.get(layer.index)
        task = UpdateTask(self._next_task_id, layer.index, layer.shard_numel, layer.compute_dtype,
                          state_in=state_in, state_out=state_out, piece_numel=self._piece_numel,
                          grad=copy.copy(grad) if grad is not None else None,
                          param_out=plan_write(layer.param_regions[param_slot]),
                          step=decision.step, hyper=decision.hyper, clip_coefficient=decision.clip_coefficient,
                          grad_dtype=self._gradient_dtype)
        handle = self.updater.submit(task)
        self._gradient_over_weights.discard(layer.index)  # the update writes new weights over it
        if speculative:
            self._speculative[layer.index] = (handle, state_slot, param_slot)
        else:
            self._commit(layer, handle, state_slot, param_slot)

    def _submit_recast(self, layer: LayerOwner) -> None:
        """Rewrite a one-slot layer's weights, which its gradient overwrote, from its committed fp32 master
        (a skipped or abandoned step): they are its cast, so they come back exactly as they were."""
        pieces = self._state_regions.get(layer.index)
        state_in = [copy.copy(piece) for piece in pieces[self._state_slot[layer.index]]] if pieces else None
        self._next_task_id += 1
        task = UpdateTask(self._next_task_id, layer.index, layer.shard_numel, layer.compute_dtype,
                          state_in=state_in, state_out=None, piece_numel=self._piece_numel, grad=None,
                          param_out=plan_write(layer.param_regions[layer.param_slot]), step=self.step_count,
                          hyper=self._hyper(), clip_coefficient=1.0, recast_only=True)
        handle = self.updater.submit(task)
        self._gradient_over_weights.discard(layer.index)
        self._commit(layer, handle, self._state_slot[layer.index], layer.param_slot)

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
        """A step failed before its decision: forget its gradients, discard its speculative updates, and
        give back the weights its gradients overwrote (every layer is released by now)."""
        self._grad_sq_norms = self._no_norms()
        for hand_over in self._hand_overs.values():
            try:
                hand_over.copied.wait()  # no copy into host memory the next step reuses may be in flight
            except Exception:
                pass
        self._hand_overs.clear()
        self._waiting_updates.clear()
        self._speculative.clear()
        for index in sorted(self._gradient_over_weights):
            try:
                self._submit_recast(self._layers[index])
            except Exception:  # the step's own error is the one raised; a fetch of this layer fails its tag check
                pass

    def flush(self) -> None:
        """Wait for every submitted update (before reading states or parameters from outside)."""
        assert not self._waiting_updates, "updates still waiting for their gradient outside a step"
        self.updater.drain()

    def read_master(self, layer: LayerOwner) -> torch.Tensor:
        """A copy of a layer's fp32 master weights (for checks and exporting the model), without its moments:
        an export holds one layer's weights, not three times that."""
        self.flush()
        if not layer.trainable:
            return torch.empty(0, dtype=torch.float32)
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
        if not layer.trainable:
            return LayerState(*(torch.empty(0, dtype=torch.float32) for _ in range(3)))
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
        self._gradient_over_weights.discard(layer.index)

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

    def _no_norms(self) -> List[Optional[float]]:
        """Each layer's squared gradient norm of a step not yet handed over: None, 0 for a layer with nothing
        to train (it hands none)."""
        return [None if layer.trainable else 0.0 for layer in self._layers]

    def _read_norms(self) -> List[float]:
        """Every layer's squared norm as a float: those on the device read back in one go (one wait)."""
        on_device = [index for index, value in enumerate(self._grad_sq_norms) if isinstance(value, torch.Tensor)]
        values = list(self._grad_sq_norms)
        if on_device:
            read = self._layers[on_device[0]].transfers.read_values(torch.stack([values[i] for i in on_device]))
            for index, value in zip(on_device, read):
                values[index] = value
        return values

    def _commit(self, layer: LayerOwner, handle: UpdateHandle, state_slot: int, param_slot: int) -> None:
        # Readers wait on the handle before they read the slots committed here.
        self._state_slot[layer.index] = state_slot
        layer.commit_update(param_slot, handle)

    def _hyper(self) -> AdamHyperparameters:
        group = self.param_groups[0]
        return AdamHyperparameters(lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1],
                                   eps=group["eps"], weight_decay=group["weight_decay"],
                                   bias_correction=group["bias_correction"])

    def step(self, closure=None) -> StepDecision:
        """The step's global part (``decide_step``), which the executor calls once every layer has handed its
        gradient. It goes through ``step`` because whatever wraps ``optimizer.step`` must see the real step
        (torch's lr schedulers count it that way: otherwise they warn "lr_scheduler.step() before
        optimizer.step()"). Called outside train_batch, with no gradient handed this step, it raises."""
        handed = [value is not None for value, layer in zip(self._grad_sq_norms, self._layers) if layer.trainable]
        if closure is not None or not any(handed):
            raise RuntimeError("the greedysnake optimizer steps inside engine.train_batch(); do not call step()")
        return self.decide_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # gradients are accumulated and handed over by the layer owners
