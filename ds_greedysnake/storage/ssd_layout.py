"""Where each layer's data lives on SSD, and how many bytes the disk must hold, before anything is allocated.

Pure arithmetic (no torch): the engine plans its regions with it, checks the disk and logs the bytes at
initialize; the planner CLI prints the same for a model that has not been built.

Per layer, on SSD (this rank's shard of ``n`` elements; ``c`` bytes per weight, ``g`` per gradient element):

* parameters: one slot of ``c*n`` bytes, updated in place, for a layer never updated speculatively (the
  layers updated after the step's decision: every layer with clipping on or the overlap off, else the front
  ``deferred_layers``); two slots for the others, whose update during backward must stay discardable until
  the decision (the second slot receives it; a skipped step keeps the first).
* optimizer states (fp32 master, exp_avg, exp_avg_sq: 12 bytes per element, in pieces): one slot or two,
  on the same rule; none for a layer whose states are in host memory (``optimizer_host_memory_mb``).
* the gradient accumulated over the step, unless it reaches the update through host memory
  (``gradient_host_memory_mb``): for a one-slot layer it is written into the parameter file (which is
  then ``max(c, g) * n`` bytes long), since between the layer's last use in backward and its update
  nobody reads its weights; a two-slot layer gets a region of its own. A skipped step, which has no
  update to write new weights over the gradient, rewrites the weights from the fp32 master instead
  (they are always its cast).

* frozen parameters (``requires_grad=False``): one read-only region of ``c`` bytes per frozen element,
  written once at initialize and read with the layer's trainable weights; no gradient, no optimizer state.
  A layer with only frozen parameters has nothing else (no slots at all).

Every region is padded to 4096 bytes with an 8-byte tag at its end (``ssd.py``).
"""
import errno
import shutil
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

ALIGNMENT = 4096
TAG_BYTES = 8
OPTIMIZER_STATE_BYTES_PER_PARAM = 12  # fp32 master, exp_avg, exp_avg_sq
KINDS = ("parameters", "frozen parameters", "optimizer states", "gradients", "activation spill")
# 4 Mi elements: a 48 MiB piece buffer, three per executing process (update_pipeline.py).
STATE_PIECE_NUMEL = 1 << 22


def round_up(num_bytes: int, multiple: int = ALIGNMENT) -> int:
    return (num_bytes + multiple - 1) // multiple * multiple


def padded_size(payload_bytes: int) -> int:
    """Bytes a region of ``payload_bytes`` occupies on SSD and in its buffer (payload, padding, tag)."""
    return round_up(payload_bytes + TAG_BYTES)


def piece_ranges(numel: int, piece_numel: int) -> List[Tuple[int, int]]:
    """[start, stop) element ranges of the pieces of a layer's states."""
    return [(start, min(start + piece_numel, numel)) for start in range(0, numel, piece_numel)]


def host_slot_offsets(order: Iterable[int], numels: Sequence[int], bytes_per_element: int,
                      budget_bytes: float) -> Dict[int, int]:
    """Offsets of the host-memory slots given to the layers of ``order``: a contiguous run from its start,
    each slot a multiple of 4096 bytes, while the running total fits the budget (host_memory.py)."""
    offsets, total = {}, 0
    for layer_index in order:
        if not numels[layer_index]:
            continue  # a layer with nothing to train has no gradient and no states
        slot_bytes = round_up(bytes_per_element * numels[layer_index], ALIGNMENT)
        if total + slot_bytes > budget_bytes:
            break
        offsets[layer_index] = total
        total += slot_bytes
    return offsets


@dataclass(frozen=True)
class LayerLayout:
    """One layer's regions on SSD."""
    numel: int                    # this rank's shard
    param_slots: int              # 1: updated in place (never speculatively); 2: speculative
    state_slots: int              # 0: states in host memory; else as param_slots
    gradient_on_ssd: bool         # False: handed over in host memory
    param_bytes: int              # payload of one parameter slot (compute dtype)
    gradient_bytes: int           # payload of the gradient (accumulation dtype)
    piece_numel: int              # elements per optimizer-state piece
    frozen_bytes: int = 0         # payload of the frozen parameters' one read-only region (0: none)

    @property
    def trainable(self) -> bool:
        return self.numel > 0

    @property
    def in_place(self) -> bool:
        return self.param_slots == 1

    @property
    def gradient_in_parameter_file(self) -> bool:
        """The gradient goes into the layer's one parameter file (see the module doc)."""
        return self.gradient_on_ssd and self.in_place

    @property
    def parameter_file_bytes(self) -> int:
        """Size of each parameter file: room for the gradient too when it shares the file."""
        payload = max(self.param_bytes, self.gradient_bytes) if self.gradient_in_parameter_file else self.param_bytes
        return padded_size(payload)

    def state_piece_bytes(self) -> List[int]:
        return [padded_size(OPTIMIZER_STATE_BYTES_PER_PARAM * (stop - start))
                for start, stop in piece_ranges(self.numel, self.piece_numel)]

    def bytes_by_kind(self) -> Dict[str, int]:
        gradients = 0
        if self.gradient_in_parameter_file:
            gradients = self.parameter_file_bytes - padded_size(self.param_bytes)  # what the gradient adds
        elif self.gradient_on_ssd:
            gradients = padded_size(self.gradient_bytes)
        return {"parameters": self.param_slots * padded_size(self.param_bytes),
                "frozen parameters": padded_size(self.frozen_bytes) if self.frozen_bytes else 0,
                "optimizer states": self.state_slots * sum(self.state_piece_bytes()),
                "gradients": gradients}


@dataclass(frozen=True)
class LayoutSettings:
    """What decides the layout; built once from the typed config (optimizer.OptimizerSettings)."""
    compute_bytes: int                 # 2 (bf16) or 4 (fp32)
    gradient_bytes: int                # per element of the accumulated gradient: 4, or 2 under bf16 accumulation
    post_decision_layers: int          # layers 0 .. k-1 are only updated after the step's decision
    gradient_host_bytes: float         # greedysnake.gradient_host_memory_mb, in bytes
    optimizer_host_bytes: float        # greedysnake.optimizer_host_memory_mb, in bytes
    piece_numel: int                   # update_pipeline.STATE_PIECE_NUMEL
    in_place_layers: Optional[int] = None  # None: every post-decision layer (two slots for the rest)


@dataclass(frozen=True)
class SsdLayout:
    layers: List[LayerLayout]

    def bytes_by_kind(self, activation_spill_bytes: int = 0) -> Dict[str, int]:
        total = {kind: 0 for kind in KINDS}
        for layer in self.layers:
            for kind, value in layer.bytes_by_kind().items():
                total[kind] += value
        total["activation spill"] = activation_spill_bytes
        return total


def plan_layout(shard_numels: Sequence[int], settings: LayoutSettings,
                frozen_shard_numels: Optional[Sequence[int]] = None) -> SsdLayout:
    """Each layer's regions: slots by the speculation rule, host slots as host_memory.py assigns them
    (gradients from the last layer down, states from layer 0 up among the post-decision layers).
    ``shard_numels``: each layer's trainable elements on this rank (0: a layer entirely frozen, which gets
    no slot); ``frozen_shard_numels``: its frozen ones (default none)."""
    count = len(shard_numels)
    frozen = list(frozen_shard_numels) if frozen_shard_numels is not None else [0] * count
    assert len(frozen) == count, (len(frozen), count)
    in_place = settings.post_decision_layers if settings.in_place_layers is None else settings.in_place_layers
    assert 0 <= in_place <= settings.post_decision_layers <= count, (in_place, settings.post_decision_layers, count)
    host_gradients = host_slot_offsets(reversed(range(count)), shard_numels, 4, settings.gradient_host_bytes)
    host_states = host_slot_offsets(range(settings.post_decision_layers), shard_numels,
                                    OPTIMIZER_STATE_BYTES_PER_PARAM, settings.optimizer_host_bytes)
    layers = []
    for index, numel in enumerate(shard_numels):
        slots = (1 if index < in_place else 2) if numel else 0
        layers.append(LayerLayout(numel, slots, 0 if index in host_states else slots,
                                  bool(numel) and index not in host_gradients, settings.compute_bytes * numel,
                                  settings.gradient_bytes * numel, settings.piece_numel,
                                  settings.compute_bytes * frozen[index]))
    return SsdLayout(layers)


def activation_spill_bytes(layer_inputs: int, micro_batches: int, checkpoint_bytes: int,
                           host_budget_bytes: float) -> int:
    """SSD bytes of the layer-input checkpoints one step spills (activations.py): forward stores the
    inputs of ``layer_inputs`` layers for every micro-batch, the first that fit the host budget in host
    memory, each of the others in a region of its own, kept across steps."""
    if checkpoint_bytes <= 0:
        return 0
    held = min(layer_inputs * micro_batches, int(host_budget_bytes // checkpoint_bytes))
    return (layer_inputs * micro_batches - held) * padded_size(checkpoint_bytes)


class SsdSpaceError(OSError):
    """The swap disk cannot hold what the run needs; the message names the bytes needed and free."""


def describe(bytes_by_kind: Dict[str, int], num_params: int, activation_known: bool = True) -> str:
    """One line: bytes per kind, the total and bytes per parameter."""
    known = {kind: value for kind, value in bytes_by_kind.items() if activation_known or kind != "activation spill"}
    total = sum(known.values())
    parts = ", ".join(f"{kind} {value:,}" for kind, value in known.items())
    if not activation_known:
        parts += ", activation spill decided by the first step's layer inputs (checked before it spills)"
    per_param = f" = {total / num_params:.2f} bytes per parameter" if num_params else ""
    return f"{parts}; total {total:,} bytes ({total / 2**30:.2f} GiB){per_param}"


def check_free_space(needed_bytes: int, folder: str, what: str) -> int:
    """Raise SsdSpaceError naming the bytes needed and free when ``folder``'s filesystem cannot hold
    ``needed_bytes`` more; returns the free bytes."""
    free = shutil.disk_usage(folder).free
    if needed_bytes > free:
        raise SsdSpaceError(errno.ENOSPC,
            f"the swap disk cannot hold this run: {what} need {needed_bytes:,} bytes ({needed_bytes / 2**30:.2f} GiB) "
            f"under {folder}, and {free:,} bytes ({free / 2**30:.2f} GiB) are free: free space there, choose another "
            "nvme_path, or give more host memory (gradient_host_memory_mb, optimizer_host_memory_mb, "
            "activation_host_memory_mb)")
    return free
