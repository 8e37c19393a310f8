"""Accumulated gradients handed to the optimizer through host memory shared with the worker process.

Without it, each layer's gradient shard goes to SSD once per step (written by training, read back by
the update): 8 bytes of SSD traffic per parameter and a synchronous write on the training path. The
arena is one anonymous shared mapping (``memfd_create``) that the worker process maps too, with a
fixed slot per layer for the layers that fit in ``greedysnake.gradient_host_memory_mb``; the other
layers keep the SSD path.

A slot is reused without a lock because the schedule orders it: a layer's gradient of step t+1 is
written during step t+1's backward, after step t+1's forward fetched that layer, and every fetch
waits for the layer's pending update, the only reader of the slot's step-t gradient. (A speculative
update discarded by a skipped step may still be reading when the slot is rewritten; its results are
never committed.)
"""
import mmap
import os
from typing import Dict, List, Optional

import torch

from .ssd import ALIGNMENT, round_up


class GradientArena:
    """Slots of fp32 gradient shards in one shared mapping; ``fd`` is handed to the worker process."""

    def __init__(self, slot_offsets: Dict[int, int], total_bytes: int, fd: Optional[int]):
        self.slot_offsets = slot_offsets
        self.total_bytes = total_bytes
        self.fd = fd
        self._mapping = mmap.mmap(fd, total_bytes) if fd is not None and total_bytes else None
        self._tensor = torch.frombuffer(self._mapping, dtype=torch.uint8) if self._mapping is not None else None

    @classmethod
    def create(cls, shard_numels: List[int], budget_bytes: int) -> "GradientArena":
        """Slots for the last layers first (backward hands them over first), while they fit the budget."""
        offsets, total = {}, 0
        for layer_index in reversed(range(len(shard_numels))):
            slot_bytes = round_up(4 * shard_numels[layer_index], ALIGNMENT)
            if total + slot_bytes > budget_bytes:
                break
            offsets[layer_index] = total
            total += slot_bytes
        if not offsets:
            return cls({}, 0, None)
        fd = os.memfd_create("greedysnake_gradients", 0)  # not inherited: the worker gets it by pass_fds
        os.ftruncate(fd, total)
        return cls(offsets, total, fd)

    @classmethod
    def attach(cls, slot_offsets: Dict[int, int], total_bytes: int, fd: int) -> "GradientArena":
        """The worker's view of the training process's arena."""
        return cls(slot_offsets, total_bytes, fd)

    def holds(self, layer_index: int) -> bool:
        return layer_index in self.slot_offsets

    def slot(self, layer_index: int, numel: int) -> torch.Tensor:
        offset = self.slot_offsets[layer_index]
        return self._tensor[offset:offset + 4 * numel].view(torch.float32)

    def close(self) -> None:
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
