"""Data parallelism, ZeRO-3 style: each rank owns 1/W of every layer's flat parameter vector.

A layer's weights are gathered once per fetch (so once per sweep, whatever the number of
micro-batches); its gradient, accumulated over all micro-batches, is reduce-scattered once per step
and averaged over the ranks; each rank runs Adam on its own shard. Collectives go through
deepspeed.comm (gloo on the CPU accelerator, NCCL on GPUs), and every byte they move is counted.
"""
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
from deepspeed import comm as dist


@dataclass(frozen=True)
class ShardLayout:
    """How one layer's ``numel`` elements are split over ``world_size`` ranks (padded to divide evenly)."""
    numel: int
    world_size: int
    rank: int

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def shard_start(self) -> int:
        return self.rank * self.shard_numel

    def own_shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full flat vector (zero padding past ``numel``)."""
        padded = torch.zeros(self.padded_numel, dtype=full.dtype, device=full.device)
        padded[:self.numel].copy_(full)
        return padded[self.shard_start:self.shard_start + self.shard_numel].clone()


class CollectiveError(RuntimeError):
    """A collective failed: another rank died, hung past the timeout, or lost its connection.

    Under gloo (the CPU accelerator) a collective fails in the call, and this error names it. Under NCCL
    collectives are asynchronous: the call returns once enqueued, and a peer that died or hung shows only
    later, in NCCL's watchdog thread, which after ``collective_timeout_seconds`` (the process group's
    timeout, set by ds_greedysnake.initialize) logs the collective that timed out and tears the process
    down (torch's TORCH_NCCL_ASYNC_ERROR_HANDLING). Only errors NCCL reports at the call (a bad tensor, a
    communicator already aborted) arrive here. docs/cuda.md says what to look for in the log."""


class DataParallel:

    def __init__(self, world_size: int, rank: int, device: torch.device, group=None):
        self.world_size = world_size
        self.rank = rank
        self.device = device  # NCCL reduces device tensors only
        self.group = group
        self.bytes_by_collective: Dict[str, int] = defaultdict(int)

    def layout(self, numel: int) -> ShardLayout:
        return ShardLayout(numel, self.world_size, self.rank)

    def gather(self, shard: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        """The full (padded) flat vector from every rank's shard (on the device: see ``gather_to_host``)."""
        if self.world_size == 1:
            return shard
        full = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
        self._run("all_gather", lambda: dist.all_gather_into_tensor(full, shard.contiguous(), group=self.group))
        self.bytes_by_collective["all_gather"] += full.numel() * full.element_size()
        return full

    def gather_pieces(self, flat: torch.Tensor, pieces: Sequence[Tuple[int, ShardLayout]]) -> List[torch.Tensor]:
        """Several vectors' full (padded) values in one all-gather: every rank's ``flat`` holds its shard of
        each at the same element offset (``pieces``: (offset, layout)); each comes out bitwise as ``gather``
        of that shard alone would give it (a gather is a copy): the rows of the gathered [rank, flat] matrix,
        cut at the offsets, one device copy per vector where they are not the whole row."""
        if self.world_size == 1:
            return [flat[offset:offset + layout.shard_numel] for offset, layout in pieces]
        rows = self.gather(flat, ShardLayout(flat.numel() * self.world_size, self.world_size, self.rank))
        rows = rows.view(self.world_size, flat.numel())
        return [rows[:, offset:offset + layout.shard_numel].reshape(-1) for offset, layout in pieces]

    def gather_to_host(self, shard: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        """The full (padded) flat vector from every rank's host shard, in host memory: the shard goes to
        the device for the collective (NCCL takes device tensors only) and the result comes back. With one
        rank, or on the CPU accelerator, no copy is made."""
        if self.world_size == 1:
            return shard
        full = self.gather(shard.to(self.device), layout)
        return full.to("cpu")

    def reduce_scatter_mean(self, full: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        """This rank's shard of the gradient summed over ranks, divided by the number of ranks."""
        if self.world_size == 1:
            return full
        shard = torch.empty(layout.shard_numel, dtype=full.dtype, device=full.device)
        self._run("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, full.contiguous(), group=self.group))
        self.bytes_by_collective["reduce_scatter"] += full.numel() * full.element_size()
        return shard.div_(self.world_size)

    def sum(self, value: float) -> float:
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        self._run("all_reduce", lambda: dist.all_reduce(tensor, group=self.group))
        self.bytes_by_collective["all_reduce"] += tensor.numel() * tensor.element_size()
        return float(tensor[0])

    def sum_each(self, values: List[float]) -> List[float]:
        """Each value summed over the ranks (every rank gives as many, in the same order): one all-reduce."""
        if self.world_size == 1 or not values:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._run("all_reduce", lambda: dist.all_reduce(tensor, group=self.group))
        self.bytes_by_collective["all_reduce"] += tensor.numel() * tensor.element_size()
        return tensor.tolist()

    def failed_ranks(self, failed: bool) -> List[int]:
        """The ranks that answer ``failed`` (each rank gives its own), known to every rank: lets all of
        them give up together before any changes anything (loading a checkpoint)."""
        if self.world_size == 1:
            return [0] if failed else []
        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        flags[self.rank] = int(failed)
        self._run("all_reduce", lambda: dist.all_reduce(flags, group=self.group))
        self.bytes_by_collective["all_reduce"] += flags.numel() * flags.element_size()
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def barrier(self) -> None:
        if self.world_size > 1:
            self._run("barrier", lambda: dist.barrier(group=self.group))

    def _run(self, name: str, collective) -> None:
        try:
            collective()
        except Exception as error:  # gloo and NCCL raise RuntimeError subclasses of their own
            raise CollectiveError(
                f"{name} across {self.world_size} ranks failed on rank {self.rank}: another rank died, hung "
                f"past the collective timeout (greedysnake.collective_timeout_seconds), or lost its connection. "
                f"Cause: {error}") from error
