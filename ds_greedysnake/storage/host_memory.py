"""Host memory shared between the training process and the optimizer worker, in per-layer slots.

Two arenas use it, each one anonymous shared mapping (``memfd_create``) that the worker maps too:

* gradients (``greedysnake.gradient_host_memory_mb``): each layer's fp32 gradient, accumulated over
  the step, reaches its Adam update here instead of through SSD, which saves 8 bytes of SSD traffic
  per parameter and a synchronous write on the training path. Slots go from the last layer down
  (backward hands those over first) while they fit; the other layers keep the SSD path.
* optimizer states (``greedysnake.optimizer_host_memory_mb``): [fp32 master | exp_avg | exp_avg_sq]
  of front layers, updated in place by the worker. Only layers updated after the step's decision are
  eligible: a speculative update must be discardable, which SSD's second slot gives and an in-place
  update does not. Slots go from layer 0 up, since the next forward waits first for those updates.

A gradient slot is reused without a lock because the schedule orders it: a layer's gradient of step
t+1 is written during step t+1's backward, after step t+1's forward fetched that layer, and every fetch
waits for the layer's pending update, the only reader of the slot's step-t gradient. (A speculative
update discarded by a skipped step may still be reading when the slot is rewritten; its results are
never committed.) A state slot is only touched by its layer's update, by checkpoint reads and
restores, and by initialisation, which all wait for pending updates first (``LayerwiseAdam.flush``).
"""
import mmap
import os
from typing import Dict, List, Optional, Sequence

import torch
from deepspeed.utils import logger

from .ssd_layout import ALIGNMENT, OPTIMIZER_STATE_BYTES_PER_PARAM, host_slot_offsets, round_up
from .transfers import register_host_memory

GRADIENT_BYTES_PER_PARAM = 4          # the fp32 gradient


class HostArena:
    """Aligned slots of fp32 data in one shared mapping; ``fd`` is handed to the worker process."""

    def __init__(self, slot_offsets: Dict[int, int], total_bytes: int, fd: Optional[int]):
        self.slot_offsets = slot_offsets
        self.total_bytes = total_bytes
        self.fd = fd
        self._mapping = mmap.mmap(fd, total_bytes) if fd is not None and total_bytes else None
        self._tensor = torch.frombuffer(self._mapping, dtype=torch.uint8) if self._mapping is not None else None
        self._unregister = None

    @classmethod
    def for_gradients(cls, shard_numels: List[int], budget_bytes: int) -> "HostArena":
        """Gradient slots for the last layers first, while they fit the budget."""
        order = reversed(range(len(shard_numels)))
        arena = cls._create("greedysnake_gradients", order, shard_numels, GRADIENT_BYTES_PER_PARAM, budget_bytes)
        arena.register_with_accelerator()
        return arena

    def register_with_accelerator(self) -> None:
        """Pin the mapping for the device's copy engine (a no-op on the CPU accelerator): gradients are
        copied into it from the device asynchronously. Only the training process registers it."""
        if self._tensor is None or self._unregister is not None:
            return
        try:
            self._unregister = register_host_memory(self._tensor.data_ptr(), self.total_bytes)
        except MemoryError as error:  # correct without: each gradient's copy out then waits for itself
            logger.warning(f"greedysnake: the gradient arena stays unregistered: {error}")

    @classmethod
    def for_optimizer_states(cls, shard_numels: List[int], eligible_layers: int, budget_bytes: int) -> "HostArena":
        """Optimizer-state slots for layers 0 .. eligible_layers-1, from layer 0 up, while they fit."""
        return cls._create("greedysnake_optimizer_states", range(eligible_layers), shard_numels,
                           OPTIMIZER_STATE_BYTES_PER_PARAM, budget_bytes)

    @classmethod
    def _create(cls, name: str, order: Sequence[int], shard_numels: List[int], bytes_per_param: int,
                budget_bytes: int) -> "HostArena":
        # A contiguous run of layers from the start of ``order``: the first that does not fit ends it (the
        # SSD layout, ssd_layout.py, assigns the same slots).
        offsets = host_slot_offsets(order, shard_numels, bytes_per_param, budget_bytes)
        if not offsets:
            return cls({}, 0, None)
        last = max(offsets, key=offsets.get)
        total = offsets[last] + round_up(bytes_per_param * shard_numels[last], ALIGNMENT)
        fd = os.memfd_create(name, 0)  # not inherited: the worker gets it by pass_fds
        os.ftruncate(fd, total)
        return cls(offsets, total, fd)

    @classmethod
    def attach(cls, slot_offsets: Dict[int, int], total_bytes: int, fd: int) -> "HostArena":
        """The worker's view of the training process's arena."""
        return cls(slot_offsets, total_bytes, fd)

    def layout(self):
        """What ``attach`` needs in the worker (the fd itself travels by pass_fds)."""
        return self.slot_offsets, self.total_bytes, self.fd

    def holds(self, layer_index: int) -> bool:
        return layer_index in self.slot_offsets

    def slot(self, layer_index: int, num_floats: int) -> torch.Tensor:
        """The first ``num_floats`` fp32 values of a layer's slot."""
        offset = self.slot_offsets[layer_index]
        return self._tensor[offset:offset + 4 * num_floats].view(torch.float32)

    def close(self) -> None:
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        self._tensor = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass  # a slot view is still referenced somewhere; the mapping goes with the process
            self._mapping = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class SharedHostMemory:
    """Both arenas, as the training process creates them and the worker attaches to them."""

    def __init__(self, gradients: HostArena, optimizer_states: HostArena):
        self.gradients = gradients
        self.optimizer_states = optimizer_states

    def layouts(self):
        return self.gradients.layout(), self.optimizer_states.layout()

    def fds(self) -> tuple:
        return tuple(arena.fd for arena in (self.gradients, self.optimizer_states) if arena.fd is not None)

    @classmethod
    def attach(cls, layouts) -> "SharedHostMemory":
        gradients, optimizer_states = (HostArena.attach(*layout) for layout in layouts)
        return cls(gradients, optimizer_states)

    def close(self) -> None:
        self.gradients.close()
        self.optimizer_states.close()
