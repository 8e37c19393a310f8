"""Checkpoints of SSD-resident training state: written to a temporary folder and published atomically,
read back safely (no pickled code runs) by any number of ranks.

What each file holds is in checkpoint_format.py. Every rank writes its shard of every layer and rank 0
the manifest and the state, all under ``<save_dir>/.tmp.<tag>``, fsynced; rank 0 renames the folder to
``<tag>`` once all ranks are done, and the ``latest`` file moves (write, fsync, rename) only after
that. A process killed at any moment of a save leaves the previous checkpoint and ``latest`` as they
were. With a ``save_total_limit``, older checkpoints are removed only after that, never the one
``latest`` names.

Only trainable parameters are saved: a layer's frozen weights never change, and come back from what the
engine is initialized with (the base model of a LoRA run), so a LoRA checkpoint holds the adapters and
their optimizer states only.

Loading checks everything first on every rank (the state loads safely, every shard a rank needs is
there and whole), agrees across ranks, and only then overwrites a layer: a checkpoint that cannot be
loaded leaves the engine as it was. W' ranks load a checkpoint of W: each re-cuts its shard of each
layer from the saved shards, one layer at a time (host memory: one shard's fp32 states).
"""
import os
import shutil
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from deepspeed.utils import logger

import torch

from .checkpoint_format import (BUFFERS, DEEPSPEED_DECOY, FORMAT_VERSION, MANIFEST, STATE, WEIGHTS_INDEX,
                                CheckpointError, LayerState, SavedCheckpoint, deepspeed_decoy, encode_layer,
                                encode_manifest, encode_state, open_checkpoint, read_manifest, write_recovery_script)

__all__ = ["FORMAT_VERSION", "LATEST", "CheckpointError", "LayerState", "CheckpointWriter", "resolve_tag",
           "write_checkpoint", "restore_checkpoint", "read_full_layer", "remove_old_checkpoints"]

LATEST = "latest"


def _fsync_path(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _save_durably(data: bytes, path: str) -> None:
    try:
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
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

    def write_layer(self, index: int, numel: int, world_size: int, state: LayerState) -> None:
        _save_durably(encode_layer(state, index, self.rank, world_size, numel),
                      os.path.join(self.staging, f"layer_{index}.rank{self.rank}.safetensors"))

    def write_state(self, state: Dict[str, Any]) -> None:
        """Rank 0: the optimizer counters, lr scheduler and client state (one copy for every rank)."""
        data, refused = encode_state(state)
        if refused:
            logger.warning(f"checkpoint {self.tag}: the state holds {', '.join(refused)}, which a safe "
                           "load_checkpoint refuses (pass trust_pickle=True to load it); keep client_state to "
                           "tensors, numbers, strings, lists and dicts to avoid that")
        _save_durably(data, os.path.join(self.staging, STATE))

    def write_weights_index(self, index: Dict[str, Any], buffers: Dict[str, torch.Tensor]) -> None:
        """Rank 0: the state_dict keys and buffers zero_to_fp32 writes, and the file that makes DeepSpeed's
        own zero_to_fp32 name it (zero_to_fp32.py)."""
        import io
        import json
        from safetensors.torch import save as safetensors_bytes
        _save_durably(json.dumps(index, indent=1).encode(), os.path.join(self.staging, WEIGHTS_INDEX))
        _save_durably(safetensors_bytes(buffers, {"format": "pt"}), os.path.join(self.staging, BUFFERS))
        decoy = io.BytesIO()
        torch.save(deepspeed_decoy(), decoy)
        _save_durably(decoy.getvalue(), os.path.join(self.staging, DEEPSPEED_DECOY))

    def write_manifest(self, world_size: int, layer_numels: Sequence[int], counters: Dict[str, Any]) -> None:
        _save_durably(encode_manifest(world_size, layer_numels, counters), os.path.join(self.staging, MANIFEST))

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
        return str(tag)
    pointer = os.path.join(load_dir, LATEST)
    if not os.path.isfile(pointer):
        raise CheckpointError(f"no tag given and no '{LATEST}' file in {load_dir}: pass tag= or save a checkpoint first")
    with open(pointer) as handle:
        return handle.read().strip()


def write_checkpoint(save_dir: str, tag: str, layers, optimizer, parallel, counters: Dict[str, Any],
                     state: Dict[str, Any], save_latest: bool, total_limit: Optional[int],
                     weights: Optional[Tuple[Dict[str, Any], Dict[str, torch.Tensor]]] = None) -> str:
    """Collective. Every rank writes its shard of every layer (``optimizer.read_layer_state``); rank 0
    writes ``state``, the manifest (``counters``: JSON values) and ``weights`` (zero_to_fp32.describe_weights),
    publishes the folder, moves ``latest``, puts ``zero_to_fp32.py`` in ``save_dir`` and removes the
    checkpoints beyond ``total_limit``."""
    writer = CheckpointWriter(save_dir, tag, parallel.rank)
    publisher = parallel.rank == 0
    if publisher:
        writer.prepare()
    parallel.barrier()
    try:
        for layer in _trainable(layers):
            writer.write_layer(layer.index, layer.numel, parallel.world_size, optimizer.read_layer_state(layer))
        if publisher:
            writer.write_state(state)
            if weights is not None:
                writer.write_weights_index(*weights)
            writer.write_manifest(parallel.world_size, [layer.numel for layer in layers], counters)
        parallel.barrier()
        if publisher:
            writer.publish(save_latest)
            write_recovery_script(save_dir)  # as DeepSpeed's engine copies its own there
    except BaseException:
        if publisher:
            writer.abandon()
        raise
    if publisher and total_limit is not None:
        remove_old_checkpoints(save_dir, total_limit, keep=[tag])
    parallel.barrier()
    return writer.final


def restore_checkpoint(load_dir: str, tag: Optional[str], layers, optimizer, parallel, with_moments: bool,
                       trust_pickle: bool = False) -> Tuple[str, Dict[str, Any]]:
    """Collective. Overwrite every layer's committed states with this rank's shard of the checkpoint
    (re-cut when it was saved by another number of ranks); return the folder and the saved state
    (global_steps, global_samples, skipped_steps, optimizer, lr_scheduler, client_state), which the
    caller applies. Nothing is overwritten unless every rank found everything it needs."""
    folder, saved, state = _agreed(parallel, lambda: _open_and_check(load_dir, tag, layers, trust_pickle))
    for layer in _trainable(layers):
        start = layer.layout.shard_start
        optimizer.restore_layer(layer, saved.read_range(layer.index, layer.numel, start, start + layer.shard_numel),
                                with_moments)
    return folder, state


def _open_and_check(load_dir: str, tag: Optional[str], layers,
                    trust_pickle: bool) -> Tuple[str, SavedCheckpoint, Dict[str, Any]]:
    folder = os.path.join(load_dir, resolve_tag(load_dir, tag))
    saved = open_checkpoint(folder, trust_pickle)
    if saved.num_layers != len(layers):
        raise CheckpointError(f"{folder} holds {saved.num_layers} layers, the model has {len(layers)}")
    state = saved.load_state()
    for layer in _trainable(layers):
        start = layer.layout.shard_start
        saved.check_layer(layer.index, layer.numel, start, start + layer.shard_numel)
    return folder, saved, state


def _trainable(layers) -> List:
    """The layers a checkpoint holds: those with trainable parameters. Frozen weights are not in it (they
    come from the model or pretrained folder the engine starts from, as with a PEFT adapter checkpoint)."""
    return [layer for layer in layers if layer.trainable]


def _agreed(parallel, prepare: Callable):
    """``prepare()`` on every rank; unless it succeeded on all of them, raise on all of them."""
    try:
        result, failure = prepare(), None
    except Exception as error:  # a bug as much as a bad file: the other ranks must not go on alone
        result, failure = None, error
    failed = parallel.failed_ranks(failure is not None)
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(f"the checkpoint cannot be loaded by rank(s) {failed} (their error names the file); "
                              "nothing was loaded on any rank")
    return result


def remove_old_checkpoints(save_dir: str, total_limit: int, keep: Sequence[str] = ()) -> List[str]:
    """Keep the ``total_limit`` most recently saved format-2 checkpoints in ``save_dir``, and those in
    ``keep`` and the one ``latest`` names whatever their age; remove the others, each renamed out of
    sight first (a kill mid-removal leaves no half checkpoint under its tag). Folders without a format-2
    manifest are neither counted nor touched. Returns the removed tags."""
    protected = set(keep)
    pointer = os.path.join(save_dir, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as handle:
            protected.add(handle.read().strip())
    saved, leftovers = [], []
    for name in os.listdir(save_dir):
        if name.startswith(".old."):
            leftovers.append(name)  # moved aside by a removal or replacement that was killed
        if name.startswith("."):
            continue
        try:
            saved.append((float(read_manifest(os.path.join(save_dir, name, MANIFEST))["saved_at"]), name))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue  # not a checkpoint of this format: not ours to remove
    saved.sort(reverse=True)
    removed = [name for _, name in saved[total_limit:] if name not in protected]
    for name in removed:
        _remove_folder(os.path.join(save_dir, name), os.path.join(save_dir, f".old.{name}.{os.getpid()}"))
    for name in leftovers:
        _remove_folder(None, os.path.join(save_dir, name))
    return removed


def _remove_folder(path: Optional[str], retired: str) -> None:
    """Rename ``path`` (if given) to ``retired``, then remove ``retired``; a failure is logged, not raised:
    the new checkpoint is saved by then."""
    try:
        if path is not None:
            os.rename(path, retired)
        shutil.rmtree(retired)
    except OSError as error:
        logger.warning(f"save_total_limit: could not remove {path or retired} ({error}); the new checkpoint is "
                       "saved: remove the old one by hand")


def read_full_layer(load_dir: str, tag: str, index: int, numel: int) -> LayerState:
    """Layer ``index``'s full, unsharded fp32 master weights and Adam moments (its first ``numel``
    elements), gathered from every saved rank's shard of checkpoint ``<load_dir>/<tag>`` (tag None:
    the one ``latest`` names). No pickled code runs; host memory: 3 x numel fp32."""
    saved = open_checkpoint(os.path.join(load_dir, resolve_tag(load_dir, tag)))
    saved.check_layer(index, numel, 0, numel)
    return saved.read_range(index, numel, 0, numel)
