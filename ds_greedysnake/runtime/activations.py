"""Layer-input checkpoints per (layer, micro-batch): host memory up to a budget, then SSD.

Forward stores the input of every layer for every micro-batch; backward takes each one once to
recompute that layer. The most recent checkpoint also stays on the device: with the snake order
the micro-batch that ends one layer starts the next, so its activation never has to come back.

Off the CPU accelerator, checkpoints leave the device on a transfer stream (``transfers.py``) into
registered host memory kept per (layer, micro-batch) across steps (reused by capacity: ``HostSlots``), and
come back the same way; device memory holds the latest checkpoint and the copies in flight (at most
``Transfers.max_pending_to_host``), whatever the number of micro-batches. Checkpoints past the budget
go to the SSD through a few staging buffers, their writes started once their copy is seen done and their
reads started ahead of the executor, in the order the schedule reads them (``spill.py``). On the CPU
accelerator the host tier keeps the tensor itself, as before.
"""
import errno
import os
import shutil
from typing import Dict, Optional, Sequence, Tuple

import torch
from deepspeed.utils import log_dist

from .spill import STAGING_BUFFERS, SpillRing
from ..storage.ssd import Region, SsdIoError, SsdStore
from ..storage.ssd_layout import activation_spill_bytes
from ..storage.transfers import Transfers, host_buffer

Key = Tuple[int, int]  # (layer, micro_batch)


class HostSlots:
    """Registered host memory per key, kept across steps and reused by capacity: each slot is raw bytes, viewed
    as the shape and dtype asked for. New memory is registered only when a key needs more bytes than its slot
    has (the old slot is dropped then; a copy still in flight keeps it alive through its guard until it ran),
    so a smaller batch (an evaluation, a short last batch) and the bigger one after it register nothing."""

    def __init__(self):
        self._raw: Dict[object, torch.Tensor] = {}

    def view(self, key, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        num_bytes = shape.numel() * torch.empty(0, dtype=dtype).element_size()
        raw = self._raw.get(key)
        if raw is None or raw.numel() < num_bytes:
            raw = host_buffer(max(num_bytes, 1))
            self._raw[key] = raw
        return raw[:num_bytes].view(dtype).view(shape)


class ActivationStore:

    def __init__(self, store: SsdStore, host_budget_bytes: int, device: torch.device, layer_inputs: int = 0,
                 micro_batches: int = 0, transfers: Optional[Transfers] = None,
                 staging_buffers: int = STAGING_BUFFERS):
        self._store = store
        self._host_budget_bytes = host_budget_bytes
        self._device = device
        # What one step stores (layers 1 .. L-1, every micro-batch): the disk is checked for all of its
        # spill before the first region of a new size is created.
        self._layer_inputs, self._micro_batches = layer_inputs, micro_batches
        self._space_checked = set()  # checkpoint sizes whose spill was checked
        self._on_host: Dict[Key, torch.Tensor] = {}
        self._regions: Dict[Key, Region] = {}  # kept across steps: the same shapes come back
        self._on_device: Optional[Tuple[Key, torch.Tensor]] = None
        self._transfers = transfers or Transfers.for_device(device)
        # Spilled checkpoints: staging buffers between the device and the SSD, writes and reads in flight.
        self._spills = SpillRing(store, self._transfers, staging_buffers)
        self._host_slots = HostSlots()  # registered host memory per key, kept across steps
        self.host_bytes = 0
        self.peak_host_bytes = 0

    def expect_reads(self, order: Sequence[Key]) -> None:
        """The order in which the step (or evaluation) reads checkpoints (``schedule.checkpoint_reads``): spilled
        ones are read from the SSD ahead of it."""
        self._spills.expect_reads(order)

    def poll(self) -> None:
        """Between two ops: start the SSD writes of spills whose copy has run, and the reads due next; no wait."""
        self._spills.poll()

    def put(self, layer: int, micro_batch: int, tensor: torch.Tensor) -> None:
        key = (layer, micro_batch)
        assert key not in self._on_host and key not in self._spills.spilled, f"checkpoint {key} stored twice"
        tensor = tensor.detach()
        self._on_device = (key, tensor)
        num_bytes = tensor.numel() * tensor.element_size()
        if self.host_bytes + num_bytes <= self._host_budget_bytes:
            self._on_host[key] = self._to_host(key, tensor)
            self.host_bytes += num_bytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        else:
            self._spill(key, tensor, num_bytes)

    def take(self, layer: int, micro_batch: int) -> torch.Tensor:
        """Hand back the checkpoint on the device and forget it."""
        key = (layer, micro_batch)
        self._spills.note_read(key)
        device_copy = None
        if self._on_device is not None and self._on_device[0] == key:
            device_copy, self._on_device = self._on_device[1], None
        if key in self._on_host:
            tensor = self._on_host.pop(key)
            self.host_bytes -= tensor.numel() * tensor.element_size()
            return device_copy if device_copy is not None else self._transfers.to_device(tensor)[0]
        if device_copy is not None:
            self._spills.drop(key)
            return device_copy
        return self._spills.read(key, keep=False)

    def peek(self, layer: int, micro_batch: int) -> torch.Tensor:
        """The checkpoint on the device, kept for backward (forward reads its input this way)."""
        key = (layer, micro_batch)
        self._spills.note_read(key)
        if self._on_device is not None and self._on_device[0] == key:
            return self._on_device[1]
        if key in self._on_host:
            return self._transfers.to_device(self._on_host[key])[0]
        return self._spills.read(key, keep=True)

    def clear(self) -> None:
        """Forget every checkpoint; no SSD transfer is left in flight (raises SsdIoError if one failed)."""
        self._on_host.clear()
        self._on_device = None
        self.host_bytes = 0
        self._spills.clear()

    def _to_host(self, key: Key, tensor: torch.Tensor) -> torch.Tensor:
        # A host slot is rewritten by a later copy on the same stream as the copies reading it: in order.
        if self._transfers.device_is_host:
            return tensor
        host = self._host_slots.view(key, tensor.shape, tensor.dtype)
        self._transfers.to_host(tensor, host)
        return host

    def _spill(self, key: Key, tensor: torch.Tensor, num_bytes: int) -> None:
        self._spills.release(key)  # nothing of its region in flight: it is rewritten, or replaced
        region = self._regions.get(key)
        if region is None or region.payload_bytes < num_bytes:
            self._check_space(key, num_bytes)
            region = self._store.create_region(f"act_l{key[0]}_m{key[1]}", num_bytes, "activation")
            self._regions[key] = region
        self._spills.spill(key, tensor, region)

    def _check_space(self, key: Key, num_bytes: int) -> None:
        """Before the first region of this size: the disk must hold the step's whole spill (every layer input
        of a step has the same size), counting the regions it replaces; else fail naming needed and free."""
        if num_bytes in self._space_checked or not self._layer_inputs:
            return
        self._space_checked.add(num_bytes)
        replaced = sum(region.padded_bytes for region in self._regions.values() if region.payload_bytes < num_bytes)
        needed = activation_spill_bytes(self._layer_inputs, self._micro_batches, num_bytes,
                                        self._host_budget_bytes) - replaced
        free = shutil.disk_usage(self._store.folder).free
        log_dist(f"greedysnake SSD space: activation spill {needed:,} more bytes (layer inputs of {num_bytes:,} bytes "
                 f"beyond activation_host_memory_mb), {free:,} bytes free under {self._store.folder}", ranks=[0])
        if needed > free:
            path = os.path.join(self._store.folder, f"{self._store.name}_act_l{key[0]}_m{key[1]}.bin")
            raise SsdIoError(errno.ENOSPC, f"no space left to allocate {needed} bytes for {path} and the other "
                             f"layer inputs this step spills to SSD ({num_bytes} bytes each), {free} bytes free: "
                             "free space on the SSD, raise greedysnake.activation_host_memory_mb or choose another "
                             "nvme_path")


class InputGradients:
    """Backward's gradient of each micro-batch's layer input, from the layer that produced it to the one
    below. The latest stays on the device (the snake: that micro-batch starts the layer below); the others
    wait in registered host memory, kept per micro-batch across layers and steps. Device memory then
    holds the latest and the copies in flight, whatever the number of micro-batches. On the CPU
    accelerator every gradient stays where it is, as before."""

    def __init__(self, device: torch.device, transfers: Optional[Transfers] = None):
        self._transfers = transfers or Transfers.for_device(device)
        self._latest: Optional[Tuple[int, torch.Tensor]] = None
        self._parked: Dict[int, torch.Tensor] = {}
        self._host_slots = HostSlots()  # registered host memory per micro-batch, kept across layers and steps

    def put(self, micro_batch: int, gradient: torch.Tensor) -> None:
        if self._latest is not None:
            self._park(*self._latest)
        self._latest = (micro_batch, gradient)

    def take(self, micro_batch: int) -> torch.Tensor:
        if self._latest is not None and self._latest[0] == micro_batch:
            gradient, self._latest = self._latest[1], None
            return gradient
        return self._transfers.to_device(self._parked.pop(micro_batch))[0]

    def clear(self) -> None:
        self._latest = None
        self._parked.clear()

    def _park(self, micro_batch: int, gradient: torch.Tensor) -> None:
        # Its slot's last reader (a copy to the device) is on the same stream as this copy: in order.
        host = gradient
        if not self._transfers.device_is_host:
            host = self._host_slots.view(micro_batch, gradient.shape, gradient.dtype)
            self._transfers.to_host(gradient, host)
        self._parked[micro_batch] = host
