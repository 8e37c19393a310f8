"""What the files of a checkpoint hold, and how each is read without running code from it.

Format 2, in ``<save_dir>/<tag>/``:

- ``checkpoint.json`` (rank 0): the format version, the number of ranks W that saved it, every
  layer's parameter count, the step counters, the compute dtype and when it was saved. Plain JSON,
  read before anything else.
- ``state.pt`` (rank 0, the same on every rank): the optimizer's step counts and hyperparameters,
  the lr scheduler's ``state_dict`` and the ``client_state``. Read with ``torch.load(weights_only=True)``,
  which builds only tensors, numbers, strings and containers, plus ``SAFE_STATE_GLOBALS``.
- ``layer_<i>.rank<r>.safetensors`` (rank r): rank r's shard of layer i's fp32 master weights and
  Adam moments (``master``, ``exp_avg``, ``exp_avg_sq``), a contiguous 1/W of the layer's flat,
  zero-padded vector (parallel.ShardLayout); the layer, rank, W and the layer's parameter count as
  metadata. No pickle at all.
- ``weights_index.json`` and ``buffers.safetensors`` (rank 0): the module's ``state_dict`` keys, each
  parameter's layer, offset in that layer's flat vector and shape, the tied aliases, and the persistent
  buffers: what ``zero_to_fp32.py`` needs to write a state dict without the model (zero_to_fp32.py).
- ``DEEPSPEED_DECOY`` (rank 0): a small torch file whose name matches the ``*_model_states.pt`` that
  DeepSpeed's own zero_to_fp32 globs for, so that its error ("<path> is not a model state checkpoint")
  names the command that converts this checkpoint.

Beside the tags, ``<save_dir>/zero_to_fp32.py`` (``RECOVERY_SCRIPT``, rewritten by each save), as DeepSpeed's
engine copies its own there: it runs ``ds_greedysnake.models.zero_to_fp32``.

Format 1 (before it): per rank ``state.rank<r>.pt`` (all of the above) and ``layer_<i>.rank<r>.pt``
(a dict of the three tensors), both pickles. They are read with the same weights-only loader: one
holding only what format 1 wrote loads, any other is refused.

A pickle that needs any other global (a class, a function) is refused with a ``CheckpointError``
naming the file and the globals: unpickling it would run code from the file. ``trust_pickle=True``
loads it anyway (unsafe: only for files whose origin you trust).

Any W' ranks read a checkpoint of W: ``read_range`` re-cuts a layer from the saved shards, reading
only the slices it needs.
"""
import io
import json
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import numpy
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

FORMAT_VERSION = 2
FORMAT_NAME = "ds_greedysnake checkpoint"
MANIFEST = "checkpoint.json"
STATE = "state.pt"
TENSOR_NAMES = ("master", "exp_avg", "exp_avg_sq")
WEIGHTS_INDEX = "weights_index.json"
BUFFERS = "buffers.safetensors"
DEEPSPEED_DECOY = "ds_greedysnake_checkpoint.convert_it_with.python_zero_to_fp32.py_in_the_folder_above_model_states.pt"
DEEPSPEED_REFUSAL = ("this is a ds_greedysnake checkpoint, which DeepSpeed's zero_to_fp32 cannot read. Convert it "
                     "with the zero_to_fp32.py in the folder above it (python zero_to_fp32.py . output_dir "
                     "--safe_serialization), or from Python with ds_greedysnake.get_fp32_state_dict_from_zero_checkpoint")

RECOVERY_SCRIPT_NAME = "zero_to_fp32.py"
RECOVERY_SCRIPT = '''#!/usr/bin/env python
"""Written by ds_greedysnake's save_checkpoint: recovers the fp32 weights of the greedysnake checkpoints
in this folder, with the command line of DeepSpeed's zero_to_fp32.py (which cannot read them):

    python zero_to_fp32.py . output_dir/ [--safe_serialization] [-t global_step14] [--max_shard_size 5GB]

The work is done by ds_greedysnake.zero_to_fp32 (python -m ds_greedysnake.zero_to_fp32 --help).
"""
import sys

try:
    from ds_greedysnake.zero_to_fp32 import main
except ImportError as error:
    sys.exit(f"zero_to_fp32.py: the checkpoints in this folder were saved by ds_greedysnake, and converting "
             f"them needs it installed ({error}): pip install the ds_greedysnake package, then run this again")

if __name__ == "__main__":
    sys.exit(main())
'''


def deepspeed_decoy() -> Dict[str, str]:
    """The content of DEEPSPEED_DECOY: no ``buffer_names``, so DeepSpeed's parse_model_states stops at it
    with ``ValueError("<its path> is not a model state checkpoint")``, and the path says what works."""
    return {"ds_greedysnake": DEEPSPEED_REFUSAL}

try:
    from numpy._core.multiarray import scalar as _numpy_scalar  # numpy 2
except ImportError:  # numpy 1
    from numpy.core.multiarray import scalar as _numpy_scalar

# Beyond torch's weights-only set: numpy scalars (np.float64 and the like), which reach the state as a
# scheduler's metric (ReduceLROnPlateau keeps the best one) or a loss kept in client_state. A numpy
# scalar is rebuilt from its dtype and raw bytes; no code of the file runs. (numpy 1 pickles name the
# function numpy.core.multiarray.scalar.)
SAFE_STATE_GLOBALS = [numpy.dtype, _numpy_scalar, (_numpy_scalar, "numpy.core.multiarray.scalar")] + [
    type(numpy.dtype(kind)) for kind in (numpy.float64, numpy.float32, numpy.float16, numpy.int64, numpy.int32,
                                         numpy.int16, numpy.int8, numpy.uint8, numpy.bool_)]


def write_recovery_script(save_dir: str) -> str:
    """``<save_dir>/zero_to_fp32.py``, replaced atomically (a killed save leaves the old one or the new one)."""
    path = os.path.join(save_dir, RECOVERY_SCRIPT_NAME)
    staged = os.path.join(save_dir, f".tmp.{RECOVERY_SCRIPT_NAME}.{os.getpid()}")
    with open(staged, "w") as handle:
        handle.write(RECOVERY_SCRIPT)
    os.chmod(staged, 0o755)
    os.replace(staged, path)
    return path


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the path."""


@dataclass
class LayerState:
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def load_pickle(path: str, trust_pickle: bool = False, mmap: bool = False) -> Any:
    """``torch.load`` of a checkpoint file, refusing anything beyond tensors, plain data and
    SAFE_STATE_GLOBALS unless ``trust_pickle`` (which lets the file run code)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing")
    try:
        if trust_pickle:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals(SAFE_STATE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        if trust_pickle:
            raise CheckpointError(f"cannot read {path}, truncated or damaged: {error}") from None
        raise CheckpointError(_refusal(path, error)) from None
    except (OSError, RuntimeError, EOFError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}, truncated or damaged: {error}") from None


def unsafe_globals(path_or_buffer) -> List[str]:
    """The globals in a torch.save file that a safe load refuses (found without unpickling)."""
    with torch.serialization.safe_globals(SAFE_STATE_GLOBALS):
        return torch.serialization.get_unsafe_globals_in_checkpoint(path_or_buffer)


def _refusal(path: str, error: Exception) -> str:
    try:
        found = ", ".join(unsafe_globals(path))
    except Exception as scan_error:  # a damaged pickle: say so rather than hide the refusal
        found = f"a pickle that cannot be scanned ({scan_error})"
    if not found:
        found = f"what torch's weights-only loader refuses ({str(error).strip().splitlines()[-1]})"
    return (f"{path} holds {found}: unpickling it could run code from the file, so it was refused and nothing "
            "was loaded. If you trust where this checkpoint came from, load_checkpoint(..., trust_pickle=True) "
            "loads it anyway (unsafe); otherwise keep client_state to tensors, numbers, strings, lists and dicts")


def encode_layer(state: LayerState, index: int, rank: int, world_size: int, numel: int) -> bytes:
    """A format-2 shard file: this rank's slices of one layer's fp32 master and moments."""
    tensors = {name: getattr(state, name).contiguous() for name in TENSOR_NAMES}
    metadata = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "layer": str(index),
                "rank": str(rank), "world_size": str(world_size), "numel": str(numel)}
    return safetensors_bytes(tensors, metadata)


def encode_manifest(world_size: int, layer_numels: Sequence[int], counters: Dict[str, Any]) -> bytes:
    manifest = dict(counters, format=FORMAT_NAME, format_version=FORMAT_VERSION, world_size=world_size,
                    num_layers=len(layer_numels), layer_numels=list(layer_numels), saved_at=time.time())
    return json.dumps(manifest, indent=1).encode()


def encode_state(state: Dict[str, Any]) -> Tuple[bytes, List[str]]:
    """The state file, and the globals in it that a safe load would refuse (empty when it loads safely)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    return data, unsafe_globals(io.BytesIO(data))


def read_manifest(path: str) -> Dict[str, Any]:
    try:
        with open(path) as handle:
            manifest = json.load(handle)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a ds_greedysnake checkpoint manifest")
    return manifest


def open_checkpoint(folder: str, trust_pickle: bool = False) -> "SavedCheckpoint":
    """A published checkpoint folder, of either format, ready to read."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint {folder} does not exist")
    if os.path.exists(os.path.join(folder, MANIFEST)):
        return SavedCheckpointV2(folder, trust_pickle)
    if os.path.exists(os.path.join(folder, "state.rank0.pt")):
        return SavedCheckpointV1(folder, trust_pickle)
    raise CheckpointError(f"{folder} holds neither {MANIFEST} (format 2) nor state.rank0.pt (format 1): "
                          "not a ds_greedysnake checkpoint, or its rank-0 files are missing")


class SavedCheckpoint:
    """One checkpoint on disk: W, the number of layers, each layer's shards, the state."""
    folder: str
    world_size: int
    num_layers: int

    def load_state(self) -> Dict[str, Any]:
        """global_steps, global_samples, skipped_steps, optimizer, lr_scheduler, client_state."""
        raise NotImplementedError

    def check_shard(self, index: int, rank: int, numel: int) -> None:
        """Raise naming the file unless layer ``index``'s shard of ``rank`` is there, whole and of this layer."""
        raise NotImplementedError

    def _read_slice(self, index: int, rank: int, start: int, stop: int,
                    names: Sequence[str] = TENSOR_NAMES) -> List[torch.Tensor]:
        raise NotImplementedError

    def shard_numel(self, numel: int) -> int:
        return -(-numel // self.world_size)

    def ranks_holding(self, numel: int, start: int, stop: int) -> range:
        """The saved ranks whose shards hold elements [start, stop) of a layer of ``numel``."""
        stop = min(stop, numel)
        if start >= stop:
            return range(0)
        shard = self.shard_numel(numel)
        return range(start // shard, (stop - 1) // shard + 1)

    def check_layer(self, index: int, numel: int, start: int, stop: int) -> None:
        if not 0 <= index < self.num_layers:
            raise CheckpointError(f"{self.folder} holds layers 0-{self.num_layers - 1}, not layer {index}")
        for rank in self.ranks_holding(numel, start, stop):
            self.check_shard(index, rank, numel)

    def read_range(self, index: int, numel: int, start: int, stop: int) -> LayerState:
        """Elements [start, stop) of layer ``index``'s full flat vectors (zero past ``numel``, as a
        shard's padding is), gathered from the saved shards that hold them: at most the range in memory."""
        return LayerState(*self.read_vectors(index, numel, start, stop, TENSOR_NAMES))

    def read_master_range(self, index: int, numel: int, start: int, stop: int) -> torch.Tensor:
        """As ``read_range``, the fp32 master weights alone (the moments are not read)."""
        return self.read_vectors(index, numel, start, stop, ("master",))[0]

    def read_vectors(self, index: int, numel: int, start: int, stop: int, names: Sequence[str]) -> List[torch.Tensor]:
        parts = [torch.zeros(stop - start, dtype=torch.float32) for _ in names]
        shard, end, position = self.shard_numel(numel), min(stop, numel), start
        while position < end:
            rank, offset = divmod(position, shard)
            count = min(end - position, shard - offset)
            for part, piece in zip(parts, self._read_slice(index, rank, offset, offset + count, names)):
                part[position - start:position - start + count].copy_(piece)
            position += count
        return parts


class SavedCheckpointV2(SavedCheckpoint):

    def __init__(self, folder: str, trust_pickle: bool):
        self.folder, self.trust_pickle = folder, trust_pickle
        self.manifest = read_manifest(os.path.join(folder, MANIFEST))
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(f"{folder} has format version {version}, this ds_greedysnake reads "
                                  f"{FORMAT_VERSION} and 1: load it with the ds_greedysnake that wrote it")
        try:
            self.world_size, self.num_layers = int(self.manifest["world_size"]), int(self.manifest["num_layers"])
            self.layer_numels = [int(numel) for numel in self.manifest["layer_numels"]]
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{folder}/{MANIFEST} is damaged: {error!r}") from None
        if len(self.layer_numels) != self.num_layers or self.world_size < 1:
            raise CheckpointError(f"{folder}/{MANIFEST} is damaged: {self.num_layers} layers, "
                                  f"{len(self.layer_numels)} sizes, {self.world_size} ranks")

    def load_state(self) -> Dict[str, Any]:
        state = load_pickle(os.path.join(self.folder, STATE), self.trust_pickle)
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.folder}/{STATE} holds a {type(state).__name__}, not the state dict")
        counters = {key: self.manifest[key] for key in ("global_steps", "global_samples", "skipped_steps")}
        return dict(state, **counters)

    def path(self, index: int, rank: int) -> str:
        return os.path.join(self.folder, f"layer_{index}.rank{rank}.safetensors")

    def check_shard(self, index: int, rank: int, numel: int) -> None:
        if self.layer_numels[index] != numel:
            raise CheckpointError(f"layer {index} in {self.folder} has {self.layer_numels[index]} parameters, "
                                  f"the model's has {numel}")
        path = self.path(index, rank)
        if not os.path.isfile(path):
            raise CheckpointError(f"shard {path} is missing (layer {index}, rank {rank} of {self.world_size})")
        expected = {"layer": str(index), "rank": str(rank), "world_size": str(self.world_size), "numel": str(numel)}
        try:
            with safe_open(path, framework="pt") as shard:  # checks the header covers the file exactly
                metadata = shard.metadata() or {}
                shapes = {name: (shard.get_slice(name).get_shape(), shard.get_slice(name).get_dtype())
                          for name in shard.keys()}
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"shard {path} is truncated or damaged: {error}") from None
        found = {key: metadata.get(key) for key in expected}
        wanted = {name: ([self.shard_numel(numel)], "F32") for name in TENSOR_NAMES}
        if found != expected or shapes != wanted:
            raise CheckpointError(f"shard {path} holds {found} {shapes}, expected {expected} {wanted}")

    def _read_slice(self, index: int, rank: int, start: int, stop: int,
                    names: Sequence[str] = TENSOR_NAMES) -> List[torch.Tensor]:
        with safe_open(self.path(index, rank), framework="pt") as shard:
            return [shard.get_slice(name)[start:stop] for name in names]


class SavedCheckpointV1(SavedCheckpoint):
    """Format 1: every rank's state file held the same counters; rank 0's is read (its client_state too)."""

    def __init__(self, folder: str, trust_pickle: bool):
        self.folder, self.trust_pickle = folder, trust_pickle
        self.state = load_pickle(os.path.join(folder, "state.rank0.pt"), trust_pickle)
        if not isinstance(self.state, dict) or self.state.get("format_version") != 1:
            raise CheckpointError(f"{folder}/state.rank0.pt is not a format-1 state file")
        self.world_size, self.num_layers = self.state["world_size"], self.state["num_layers"]

    def load_state(self) -> Dict[str, Any]:
        return self.state

    def path(self, index: int, rank: int) -> str:
        return os.path.join(self.folder, f"layer_{index}.rank{rank}.pt")

    def _load_shard(self, index: int, rank: int) -> Dict[str, torch.Tensor]:
        path = self.path(index, rank)
        if not os.path.isfile(path):
            raise CheckpointError(f"shard {path} is missing (layer {index}, rank {rank} of {self.world_size})")
        return load_pickle(path, self.trust_pickle, mmap=True)  # mmap: slices read only their pages

    def check_shard(self, index: int, rank: int, numel: int) -> None:
        tensors = self._load_shard(index, rank)
        if not isinstance(tensors, dict):
            raise CheckpointError(f"shard {self.path(index, rank)} holds a {type(tensors).__name__}, "
                                  "not a dict of tensors")
        sizes = {name: tensors[name].numel() if isinstance(tensors.get(name), torch.Tensor) else None
                 for name in TENSOR_NAMES}
        # Format 1 did not record the layer's size: a shard of this model's layer has ceil(numel / W).
        if set(sizes.values()) != {self.shard_numel(numel)}:
            raise CheckpointError(f"shard {self.path(index, rank)} holds {sizes} elements, layer {index} of this "
                                  f"model needs {self.shard_numel(numel)} per rank of {self.world_size}")

    def _read_slice(self, index: int, rank: int, start: int, stop: int,
                    names: Sequence[str] = TENSOR_NAMES) -> List[torch.Tensor]:
        tensors = self._load_shard(index, rank)
        return [tensors[name][start:stop].float() for name in names]
