"""Checkpoints of SSD-resident training state, written to a temporary folder and published atomically.

Layout of ``<save_dir>/<tag>/``: one ``layer_<i>.rank<r>.pt`` per layer (fp32 master weights and
Adam moments; the low-precision weights are their cast), and ``state.rank<r>.pt`` with the step
counts, learning-rate scheduler, optimizer hyperparameters and the client state. Everything is
written under ``<save_dir>/.tmp.<tag>`` (every rank its own files), fsynced, then renamed to
``<tag>`` by rank 0 once all ranks are done; the ``latest`` file moves (write, fsync, rename) only
after that. A process killed at any moment of a save leaves the previous checkpoint and ``latest``
as they were.
"""
import os
import shutil
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

FORMAT_VERSION = 1
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the path."""


@dataclass
class LayerState:
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def _fsync_path(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _save_durably(obj: Any, path: str) -> None:
    try:
        with open(path, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except (OSError, RuntimeError) as error:
        written = os.path.getsize(path) if os.path.exists(path) else 0
        raise CheckpointError(f"writing checkpoint file {path} failed after {written} bytes ({error}); "
                              "the previous checkpoint and 'latest' are untouched") from None


class CheckpointWriter:
    """Writes one rank's files of one checkpoint. Rank 0 ``prepare``s the staging folder before the
    ranks write and ``publish``es it after all have written (the caller puts barriers between)."""

    def __init__(self, save_dir: str, tag: str, rank: int):
        if not tag or os.sep in tag or tag.startswith("."):
            raise CheckpointError(f"checkpoint tag {tag!r} must be a plain folder name (no '/', not hidden)")
        self.save_dir, self.tag, self.rank = save_dir, tag, rank
        self.final = os.path.join(save_dir, tag)
        self.staging = os.path.join(save_dir, f".tmp.{tag}")

    def prepare(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)  # left by a save that was killed
        try:
            os.makedirs(self.staging)
        except OSError as error:
            raise CheckpointError(f"writing checkpoint folder {self.staging} failed ({error}); the previous "
                                  "checkpoint and 'latest' are untouched") from None

    def write_layer(self, index: int, state: LayerState) -> None:
        _save_durably({"master": state.master, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq},
                      os.path.join(self.staging, f"layer_{index}.rank{self.rank}.pt"))

    def write_state(self, state: Dict[str, Any]) -> None:
        _save_durably(dict(state, format_version=FORMAT_VERSION),
                      os.path.join(self.staging, f"state.rank{self.rank}.pt"))

    def publish(self, save_latest: bool) -> str:
        _fsync_path(self.staging)
        if os.path.exists(self.final):
            # Replacing a checkpoint of the same tag: move the old one aside first, so a crash leaves
            # either the old or the new one under the tag, then remove it.
            retired = os.path.join(self.save_dir, f".old.{self.tag}.{os.getpid()}")
            os.rename(self.final, retired)
            os.rename(self.staging, self.final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(self.staging, self.final)
        _fsync_path(self.save_dir)
        if save_latest:
            pointer = os.path.join(self.save_dir, f".tmp.{LATEST}.{os.getpid()}")
            with open(pointer, "w") as handle:
                handle.write(self.tag)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(pointer, os.path.join(self.save_dir, LATEST))
            _fsync_path(self.save_dir)
        return self.final

    def abandon(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def resolve_tag(load_dir: str, tag: Optional[str]) -> str:
    if tag is not None:
        return tag
    pointer = os.path.join(load_dir, LATEST)
    if not os.path.isfile(pointer):
        raise CheckpointError(f"no tag given and no '{LATEST}' file in {load_dir}: pass tag= or save a checkpoint first")
    with open(pointer) as handle:
        return handle.read().strip()


class CheckpointReader:

    def __init__(self, load_dir: str, tag: str, rank: int, num_layers: int, world_size: int):
        self.folder = os.path.join(load_dir, tag)
        self.rank = rank
        if not os.path.isdir(self.folder):
            raise CheckpointError(f"checkpoint {self.folder} does not exist")
        self.state = self._load(f"state.rank{rank}.pt")
        if self.state.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{self.folder} has format version {self.state.get('format_version')}, "
                                  f"this ds_greedysnake reads {FORMAT_VERSION}")
        if self.state["world_size"] != world_size:
            raise CheckpointError(f"{self.folder} was saved by {self.state['world_size']} ranks and is loaded by "
                                  f"{world_size}: each rank stores its own shard; resume with the same number of ranks")
        if self.state["num_layers"] != num_layers:
            raise CheckpointError(f"{self.folder} holds {self.state['num_layers']} layers, the model has {num_layers}")

    def read_layer(self, index: int, numel: int) -> LayerState:
        saved = self._load(f"layer_{index}.rank{self.rank}.pt")
        state = LayerState(saved["master"], saved["exp_avg"], saved["exp_avg_sq"])
        if state.master.numel() != numel:
            raise CheckpointError(f"layer {index} in {self.folder} has {state.master.numel()} parameters, "
                                  f"the model's has {numel}")
        return state

    def _load(self, name: str) -> Dict[str, Any]:
        path = os.path.join(self.folder, name)
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except (OSError, RuntimeError, EOFError) as error:
            raise CheckpointError(f"cannot read {path}: {error}") from None



def read_full_layer(load_dir: str, tag: str, index: int, numel: int) -> LayerState:
    """Layer ``index``'s full fp32 master weights and Adam moments (its first ``numel`` elements),
    gathered from every saved rank's shard: for tools that read a checkpoint outside training
    (``python -m ds_greedysnake.export``). Holds one layer at a time."""
    folder = os.path.join(load_dir, tag)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint {folder} does not exist")

    def load(name: str) -> Dict[str, Any]:
        path = os.path.join(folder, name)
        try:
            # Memory-mapped: what the caller never touches (an export leaves the moments) is never read.
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except (OSError, RuntimeError, EOFError) as error:
            raise CheckpointError(f"cannot read {path}: {error}") from None

    world_size = load("state.rank0.pt")["world_size"]
    shards = [load(f"layer_{index}.rank{rank}.pt") for rank in range(world_size)]
    parts = []
    for key in ("master", "exp_avg", "exp_avg_sq"):
        pieces = [shard[key].reshape(-1) for shard in shards]
        full = pieces[0] if world_size == 1 else torch.cat(pieces)
        # Each rank saved ceil(numel / world_size) elements, the last one zero-padded.
        if not numel <= full.numel() < numel + world_size:
            raise CheckpointError(f"layer {index} in {folder} holds {full.numel()} elements over {world_size} "
                                  f"rank(s), the model's layer has {numel}: not this model's checkpoint")
        parts.append(full[:numel])
    return LayerState(*parts)
