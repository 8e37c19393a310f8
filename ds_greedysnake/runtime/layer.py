"""One owner per layer: where its parameters are, and its gradient over the micro-batches of a step.

A layer's low-precision parameters live on SSD as a flat vector. A layer updated during backward,
before the step's decision (speculatively), has two slots: the optimizer writes new weights into the
slot not in use and commits it with the completion handle of that update, or leaves it uncommitted
when the step is skipped. Every other layer has one slot, written in place (ssd_layout.py): its update
only starts once the decision has found every gradient finite, so there is nothing to discard, and
every read of the slot waits for the update first. ``prefetch`` starts reading the committed slot
into a host buffer from a small shared pool (unless its update is still running), ``fetch`` waits for
the update and the read and points the module's parameters at the data on the device, ``release``
drops them (waiting for a read in flight), and a layer is only updated once released, so no read of
its slot is ever in flight while an update writes it. Each verb is a no-op when already done.
 ``stage`` starts the device copy ahead of ``fetch`` (off the CPU accelerator).

Frozen parameters (``requires_grad=False``) are a second flat vector of the layer, in one read-only region
written once at ``offload``: read together with the committed slot into the same host buffer (one read of
both regions), bound with the trainable ones, never updated, with no gradient. A layer with no trainable
parameter (``trainable`` false) has no slot at all: it is fetched and released, never updated.

Copies to the device run on a transfer stream (``transfers.py``): a host buffer goes back to the pool
with the guard of the copy reading it, and the pool hands it out again (to the next aio read) only
once that copy has completed. With several ranks a fetch makes one copy and one all-gather (trainable and
frozen shards together), the gather on a stream of its own after the copy, which the compute waits for
(on the device) when the weights are bound.
"""
from enum import Enum
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import deepspeed_compat
from .parallel import DataParallel, ShardLayout
from ..storage.ssd import Region, SsdStore, padded_size
from ..storage.ssd_layout import LayerLayout
from ..storage.transfers import COMPLETE, Guard, Transfers
from ..optim.updates import UpdateHandle


class Residency(Enum):
    ON_SSD = "on_ssd"
    READING = "reading"
    RESIDENT = "resident"


class BufferPool:
    """A fixed number of equal aligned host buffers of one store; running out is a scheduling bug. Each
    free buffer travels with the guard of the last device copy reading it."""

    def __init__(self, store: SsdStore, num_bytes: int, count: int):
        self._free: List[Tuple[torch.Tensor, Guard]] = [(store.buffer(num_bytes), COMPLETE) for _ in range(count)]

    def acquire(self) -> torch.Tensor:
        """The buffer given back last whose copy has completed; if none has, the oldest, once its has."""
        assert self._free, "parameter buffer pool exhausted: more layers in flight than buffers"
        for index in range(len(self._free) - 1, -1, -1):
            if self._free[index][1].done():
                return self._free.pop(index)[0]
        buffer, guard = self._free.pop(0)
        guard.wait()
        return buffer

    def give_back(self, buffer: torch.Tensor, guard: Guard = COMPLETE) -> None:
        self._free.append((buffer, guard))


class LayerOwner:

    def __init__(self, index: int, module: nn.Module, compute_dtype: torch.dtype, device: torch.device,
                 parallel: DataParallel, borrowed: Sequence[nn.Parameter] = ()):
        self.index = index
        self.module = module
        # Borrowed parameters (tied embeddings) belong to a lender layer: stored, updated and checkpointed there.
        borrowed_ids = {id(param) for param in borrowed}
        own = [p for p in module.parameters() if id(p) not in borrowed_ids]
        # Trainable parameters: slots, gradient, optimizer states. Frozen ones: one read-only region.
        self.params: List[nn.Parameter] = [p for p in own if p.requires_grad]
        self.frozen_params: List[nn.Parameter] = [p for p in own if not p.requires_grad]
        # Layers whose parameters this one borrows: resident while it is, and its gradient for them goes to them.
        self.lenders: List["LayerOwner"] = []
        # Shapes are kept here: a released parameter's .data is an empty placeholder.
        self.param_shapes: List[torch.Size] = [deepspeed_compat.logical_shape(p) for p in self.params]
        self.numel = sum(shape.numel() for shape in self.param_shapes)
        self.parallel = parallel
        self.layout = parallel.layout(self.numel)
        self.shard_numel = self.layout.shard_numel  # what this rank stores, on SSD and in the optimizer
        self.frozen_shapes: List[torch.Size] = [deepspeed_compat.logical_shape(p) for p in self.frozen_params]
        self.frozen_numel = sum(shape.numel() for shape in self.frozen_shapes)
        self.frozen_layout = parallel.layout(self.frozen_numel)
        self.frozen_region: Optional[Region] = None
        self.compute_dtype = compute_dtype
        self._element_bytes = torch.empty(0, dtype=compute_dtype).element_size()
        self.device = device
        self.state = Residency.RESIDENT  # the module holds its initial weights until offload()
        self.param_regions: List[Region] = []
        self.param_slot = 0
        self.pending_update: Optional[UpdateHandle] = None
        # A one-slot layer's file holds this step's gradient instead of its weights, from its gradient's
        # flush to its update (optimizer.py): nothing may read the slot meanwhile.
        self.weights_hold_gradient = False
        self._store: Optional[SsdStore] = None
        self._pool: Optional[BufferPool] = None
        self._host_buffer: Optional[torch.Tensor] = None
        self.transfers = Transfers.for_device(device)
        # The full trainable and frozen weights on the device, not bound yet (stage), with the guard of the
        # gather that produced them (the compute waits for it when they are bound).
        self._staged: Optional[Tuple[torch.Tensor, torch.Tensor, Guard]] = None
        self._grad_accumulator: Optional[torch.Tensor] = None
        self._move_buffers_to(device)

    def _move_buffers_to(self, device: torch.device) -> None:
        # Buffers (masks, rotary tables) are small and stay on the device; parameters do not move
        # here, so the whole model is never on the device at once.
        for submodule in self.module.modules():
            for name, buffer in submodule._buffers.items():
                if buffer is not None:
                    submodule._buffers[name] = buffer.to(device)

    @property
    def trainable(self) -> bool:
        """Has parameters to train: a gradient, optimizer states and updates."""
        return self.numel > 0

    @property
    def shard_bytes(self) -> int:
        return self.shard_numel * self._element_bytes

    @property
    def frozen_shard_bytes(self) -> int:
        return self.frozen_layout.shard_numel * self._element_bytes

    @property
    def read_buffer_bytes(self) -> int:
        """Host buffer bytes a read of this layer needs: its committed slot, then its frozen region."""
        return ((padded_size(self.shard_bytes) if self.trainable else 0)
                + (padded_size(self.frozen_shard_bytes) if self.frozen_numel else 0))

    @property
    def _frozen_offset(self) -> int:
        """Where the frozen region's bytes start in a read buffer (after the trainable slot's)."""
        return padded_size(self.shard_bytes) if self.trainable else 0

    @property
    def region(self) -> Region:
        """The committed parameter slot."""
        return self.param_regions[self.param_slot]

    def flat_parameters(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The current trainable and frozen weights, each as one flat host vector in the compute dtype
        (initialisation only).

        A model built under zero.Init is gathered one layer at a time, so the whole model never has
        to be in memory at once; its ZeRO-3 partitions are dropped once the copy is taken.
        """
        def flat(params):
            return torch.cat([p.detach().reshape(-1).to("cpu", self.compute_dtype) for p in params] +
                             [torch.empty(0, dtype=self.compute_dtype)])

        everything = self.params + self.frozen_params
        with deepspeed_compat.gathered(everything):
            trainable, frozen = flat(self.params), flat(self.frozen_params)
        for param in everything:
            deepspeed_compat.drop_zero3_partition(param)
        return trainable, frozen

    def offload(self, store: SsdStore, pool: BufferPool, shard: torch.Tensor, layout: LayerLayout,
                frozen_shard: Optional[torch.Tensor] = None) -> None:
        """Write this rank's shard of the initial weights (and of the frozen ones, once and for all) to SSD
        and drop the weights from memory. The files are as long as ``layout`` says (a one-slot layer's file
        may also hold its gradient)."""
        assert layout.param_bytes == self.shard_bytes, (layout.param_bytes, self.shard_bytes)
        assert layout.frozen_bytes == (self.frozen_shard_bytes if self.frozen_numel else 0), self.index
        self._store, self._pool = store, pool
        self.param_regions = [store.create_region(f"l{self.index}_s{slot}", self.shard_bytes, "param",
                                                  file_bytes=layout.parameter_file_bytes)
                              for slot in range(layout.param_slots)]
        if self.frozen_numel:
            self.frozen_region = store.create_region(f"l{self.index}_frozen", self.frozen_shard_bytes, "frozen")
            buffer = pool.acquire()
            buffer[:self.frozen_shard_bytes].view(self.compute_dtype).copy_(frozen_shard)
            store.write(self.frozen_region, buffer)
            pool.give_back(buffer)
        self._drop_parameters()
        self.state = Residency.ON_SSD
        if self.trainable:
            self.overwrite_weights(shard)

    def read_frozen(self) -> torch.Tensor:
        """The layer's full frozen weights (gathered over the ranks: every rank calls it) as a host copy in
        the compute dtype, read from their region (exporting the model: between steps; the region is never
        written again, so a read of the layer in flight does not matter)."""
        if not self.frozen_numel:
            return torch.empty(0, dtype=self.compute_dtype)
        buffer = self._pool.acquire()
        try:
            self._store.read(self.frozen_region, buffer)
            shard = buffer[:self.frozen_shard_bytes].view(self.compute_dtype).clone()
        finally:
            self._pool.give_back(buffer)
        return self.parallel.gather_to_host(shard, self.frozen_layout)[:self.frozen_numel].clone()

    def overwrite_weights(self, shard: torch.Tensor) -> None:
        """Replace this rank's committed weights (initialisation, loading a checkpoint); layer not in use."""
        assert self.state == Residency.ON_SSD and self.pending_update is None, (self.index, self.state)
        buffer = self._pool.acquire()
        buffer[:self.shard_bytes].view(self.compute_dtype).copy_(shard)
        self._store.write(self.region, buffer)
        self._pool.give_back(buffer)
        self.weights_hold_gradient = False

    def gradient_region(self, payload_bytes: int) -> Region:
        """A region for this step's gradient over the start of the one parameter file (ssd_layout.py), with a
        tag of its own: a read of the weights while the gradient is there fails, and the other way round."""
        assert self.in_place, f"layer {self.index} has two parameter slots: its gradient has a file of its own"
        return self._store.alias_region(self.param_regions[0], payload_bytes, "grad")

    @property
    def in_place(self) -> bool:
        """One parameter slot, updated in place (never speculatively)."""
        return len(self.param_regions) == 1

    @property
    def next_param_slot(self) -> int:
        """The slot an update writes: the one not committed, or the only one."""
        return (self.param_slot + 1) % len(self.param_regions)

    def commit_update(self, param_slot: int, handle: UpdateHandle) -> None:
        """New weights are (being) written to ``param_slot``; readers wait on ``handle`` first."""
        assert self.state == Residency.ON_SSD, f"layer {self.index} updated while {self.state.value}"
        self.param_slot = param_slot
        self.pending_update = handle
        self.weights_hold_gradient = False

    def wait_for_update(self) -> None:
        if self.pending_update is not None:
            self.pending_update.wait()
            self.pending_update = None

    def prefetch(self) -> None:
        if self.state != Residency.ON_SSD:
            return
        if self.pending_update is not None and not self.pending_update.done():
            return  # its new weights are still being written; fetch waits for them
        self._start_read()

    def fetch(self) -> None:
        self._fetch_own()
        # The lender's fetch (after this layer's own) waits for the lender's pending update, so the
        # borrowed weights are current.
        for lender in self.lenders:
            lender.fetch()

    def stage(self) -> None:
        """Start this layer's copy to the device now (waiting for its SSD read), binding nothing: called
        before the executor waits for the device, so that the copy overlaps the compute queued before it.
        A no-op on the CPU accelerator, and once resident or staged."""
        if self.transfers.device_is_host or self.state == Residency.RESIDENT or self._staged is not None:
            return
        self._staged = self._copy_in()

    def _fetch_own(self) -> None:
        if self.state == Residency.RESIDENT:
            return
        flat, frozen, gathered = self._staged if self._staged is not None else self._copy_in()
        self._staged = None
        self.transfers.compute_waits_for(gathered)  # on the device, just before the layer's compute
        for params, shapes, values in ((self.params, self.param_shapes, flat),
                                       (self.frozen_params, self.frozen_shapes, frozen)):
            offset = 0
            for param, shape in zip(params, shapes):
                param.data = values[offset:offset + shape.numel()].view(shape)
                offset += shape.numel()
        self.state = Residency.RESIDENT

    def _copy_in(self) -> Tuple[torch.Tensor, torch.Tensor, Guard]:
        """The full trainable and frozen weights on the device: the read waited for, copied on the inbound
        stream (compute waits for it on the device), gathered over the ranks (``_gather_in``); with the
        guard of the gather."""
        if self.state == Residency.ON_SSD:
            self.wait_for_update()
            self._start_read()
        self._store.wait_for_read(self._host_buffer)
        buffer = self._host_buffer
        if self.parallel.world_size > 1:
            full, copied, gathered = self._gather_in(buffer)
        else:
            (full, copied), gathered = self._copy_shards_in(buffer), COMPLETE
        if all(not _views(values, buffer) for values in full):
            self._pool.give_back(buffer, copied)  # reused once the copies completed
            self._host_buffer = None
        return full[0], full[1], gathered

    def _shard_pieces(self) -> List[Tuple[int, int, ShardLayout]]:
        """Where the trainable and the frozen shard lie in a read buffer: (byte offset, bytes, layout)."""
        return [(0, self.shard_bytes, self.layout),
                (self._frozen_offset, self.frozen_shard_bytes, self.frozen_layout)]

    def _copy_shards_in(self, buffer: torch.Tensor) -> Tuple[List[torch.Tensor], Guard]:
        """One rank: the trainable and frozen weights on the device (on the CPU accelerator, views of
        ``buffer``), and the guard of the last copy."""
        copied = COMPLETE
        full = []
        for offset, num_bytes, _ in self._shard_pieces():
            if not num_bytes:
                full.append(torch.empty(0, dtype=self.compute_dtype, device=self.device))
                continue
            shard = buffer[offset:offset + num_bytes].view(self.compute_dtype)
            # The CPU accelerator: the host buffer itself. Copies on one stream: the last one's guard covers both.
            shard, copied = self.transfers.to_device(shard)
            full.append(shard)
        return full, copied

    def _gather_in(self, buffer: torch.Tensor) -> Tuple[List[torch.Tensor], Guard, Guard]:
        """Several ranks: the full trainable and frozen weights from ONE copy to the device and ONE
        all-gather per fetch, not one of each per vector (a LoRA layer has both): the copy and the gather
        take the read buffer from the trainable shard's start to the frozen one's end, the trainable region's
        padding and tag between them included (under 4 KiB per rank, cheaper than packing the two shards
        into one vector first), and ``gather_pieces`` cuts each vector out of the gathered rows. Off the CPU
        the gather runs on the gather stream, after the copy and not after the compute
        (``Transfers.gather_to_device``); the compute waits for it when the weights are bound."""
        present = [(offset, num_bytes, layout) for offset, num_bytes, layout in self._shard_pieces() if num_bytes]
        span = max(offset + num_bytes for offset, num_bytes, _ in present)
        gathered, copied, done = self.transfers.gather_to_device(
            buffer[:span].view(self.compute_dtype),
            lambda shard: self.parallel.gather_pieces(
                shard, [(offset // self._element_bytes, layout) for offset, _, layout in present]))
        values = iter(gathered)
        full = [next(values) if num_bytes else torch.empty(0, dtype=self.compute_dtype, device=self.device)
                for _, num_bytes, _ in self._shard_pieces()]
        return full, copied, done

    def release(self) -> None:
        for lender in self.lenders:
            lender.release()
        if self.state == Residency.ON_SSD:
            return
        if self.state == Residency.READING:
            self._store.wait_for_read(self._host_buffer)
        self._drop_parameters()
        self._staged = None
        if self._host_buffer is not None:
            self._pool.give_back(self._host_buffer)
            self._host_buffer = None
        self.state = Residency.ON_SSD

    def _start_read(self) -> None:
        assert not self.weights_hold_gradient, f"layer {self.index} read before its update wrote its weights"
        self.pending_update = None  # finished: polled or waited by the caller
        self._host_buffer = self._pool.acquire()
        regions = ([self.region] if self.trainable else []) + ([self.frozen_region] if self.frozen_numel else [])
        self._store.start_read_regions(regions, self._host_buffer)
        self.state = Residency.READING

    def _drop_parameters(self) -> None:
        for param in self.params + self.frozen_params:
            param.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)

    # ------------------------------------------------------------------ gradients

    def accumulate_grads(self, accumulate_dtype: torch.dtype) -> None:
        """Add this micro-batch's parameter gradients into the layer's flat accumulator.

        Where the accumulator has the parameters' dtype, each ``param.grad`` then becomes a view into
        it, so autograd adds the next micro-batches' gradients in place (what DDP's
        gradient_as_bucket_view does): no fresh gradient tensor and no extra pass per micro-batch.
        """
        if not self.trainable:
            for lender in self.lenders:
                lender.accumulate_grads(accumulate_dtype)
            return
        if self._grad_accumulator is None:
            # Padded to divide over the ranks; the padding stays zero.
            self._grad_accumulator = torch.zeros(self.layout.padded_numel, dtype=accumulate_dtype, device=self.device)
        offset = 0
        for param, shape in zip(self.params, self.param_shapes):
            view = self._grad_accumulator[offset:offset + shape.numel()].view(shape)
            if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                view.add_(param.grad)
            param.grad = view if view.dtype == param.dtype else None
            offset += shape.numel()
        for lender in self.lenders:
            # The borrowed parameters' gradient: the lender flushes after this layer (it is layer 0).
            lender.accumulate_grads(accumulate_dtype)

    def take_grads(self) -> torch.Tensor:
        """This rank's shard of the gradient accumulated over every micro-batch of this step, averaged
        over the ranks (one reduce-scatter per step); the owner forgets it."""
        assert self._grad_accumulator is not None, f"layer {self.index} has no gradient this step"
        grads, self._grad_accumulator = self._grad_accumulator, None
        for param in self.params:
            param.grad = None  # views into the accumulator handed over here
        return self.parallel.reduce_scatter_mean(grads, self.layout)

    def discard_grads(self) -> None:
        self._grad_accumulator = None
        for param in self.params:
            param.grad = None


def _views(values: torch.Tensor, buffer: torch.Tensor) -> bool:
    """``values`` is (a view of) ``buffer``'s memory, not a copy."""
    return values.numel() > 0 and values.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
