"""The ``"greedysnake"`` block of ds_config.json, and the checks that the rest of the config suits it.

Every field is typed and documented; unknown keys are rejected by DeepSpeed's config base class.
``check_ds_config`` holds every cross-field rule in one place, and each error names the value
it found and how to fix it.
"""
import errno
import mmap
import os
import tempfile
from typing import Any, Dict, Optional

from pydantic import ConfigDict, Field, ValidationError
from deepspeed.runtime.config_utils import DeepSpeedConfigModel

GREEDYSNAKE_KEY = "greedysnake"


class GreedySnakeConfigError(ValueError):
    """A ds_config that greedysnake cannot run; the message names the value and the fix."""


class GreedySnakeConfig(DeepSpeedConfigModel):
    """Settings of the vertical (GreedySnake) engine, read from ``ds_config["greedysnake"]``."""

    # Parsed once, at initialize, and shared by every module through ``settings.Settings``: nobody may
    # change a field under the others (``Settings.with_greedysnake`` makes a new block instead).
    model_config = ConfigDict(frozen=True)

    enabled: bool = False
    """Run the vertical engine. False (or no block) gives DeepSpeed's own ZeRO-Infinity engine,
    so one training script does the A/B comparison."""

    activation_host_memory_mb: float = Field(4096.0, ge=0)
    """Host memory (MiB) for layer-input checkpoints of all micro-batches; past it, checkpoints
    spill to SSD under ``<nvme_path>/greedysnake``. 0 spills every checkpoint. Spilled checkpoints pass
    through up to four staging buffers of one checkpoint each (``spill.STAGING_BUFFERS``): host memory
    beside this budget, used only when something spills."""

    gradient_host_memory_mb: float = Field(1024.0, ge=0)
    """Host memory (MiB) that hands each layer's accumulated fp32 gradient (this rank's shard) to its
    Adam update without going through SSD, saving 8 bytes of SSD traffic per parameter per step and
    a synchronous write. Layers are given a slot from the last one down while they fit; the others
    write their gradient to SSD. 0 sends every gradient through SSD."""

    optimizer_host_memory_mb: float = Field(1024.0, ge=0)
    """Host memory (MiB), shared with the optimizer worker, that keeps the optimizer states (fp32
    master and both Adam moments, 12 bytes per parameter of this rank's shard) of the front layers
    instead of SSD. Only layers updated after the step's decision are eligible (the front
    ``deferred_layers``; every layer with ``optimizer_overlap`` off or gradient clipping on): they
    are updated in place, while a speculative update needs SSD's second slot to be discardable.
    Layers are given a slot from layer 0 up while they fit. Their update then reads and writes no
    state on SSD, which matters most for the layers the next forward waits on first. 0 keeps every
    state on SSD."""

    optimizer_read_ahead_mb: float = Field(0.0, ge=0)
    """Host memory (MiB, locked in the optimizer worker) for reading optimizer states early. After a
    step's last update the worker has nothing to do until the next backward hands it a gradient; it
    reads the states the next updates will need first (the last layers', in pieces of up to 4 Mi
    elements, 12 bytes each) into this many spare buffers meanwhile, so that SSD time is not lost.
    Only with ``optimizer_overlap``. Off (0) by default: on this project's 2-core test machine it did not
    make steps faster (docs/ab_bench.md); try it where the worker idles before backward."""

    fp32_grad_accumulation: bool = True
    """Accumulate each layer's gradient over the micro-batches in fp32, whatever the compute
    dtype. Only matters under bf16; fp32 training always accumulates in fp32. False accumulates in
    bf16, and a gradient that goes through SSD is stored in bf16 there (half the bytes; its cast to
    fp32 for Adam is exact)."""

    prefetch: bool = True
    """Read the next layer's parameters from SSD while the current layer computes."""

    prefetch_depth: int = Field(1, ge=1)
    """With ``prefetch``, how many layers' parameter reads are kept in flight ahead of the layer
    computing, each on its own aio handle. 2 keeps a read queued behind the one the SSD serves, which
    a disk that idles between requests needs (docs/ab_bench.md). Each one more costs a host buffer of
    the largest layer's parameters (this rank's shard, in the compute dtype)."""

    optimizer_overlap: bool = True
    """Run each layer's Adam update in a worker process while training goes on: during backward for
    layers ``deferred_layers`` and up (speculatively, committed or discarded once every gradient is
    known), during the next forward for the front layers. False runs every update after backward."""

    deferred_layers: Optional[int] = Field(None, ge=0)
    """With the overlap, how many layers counted from the front (the embedding is layer 0) are
    updated during the next forward instead of during backward. Default: a quarter of the layers,
    at least one. With gradient_clipping on, every layer is deferred, since the clip coefficient
    needs every gradient first."""

    optimizer_worker_threads: Optional[int] = Field(None, ge=1)
    """CPU threads of the optimizer worker process (the training process keeps the rest). Default: on
    DeepSpeed's CPU accelerator 1, since training computes on the same cores; with a GPU, the cores this
    rank may use (the process's CPU affinity divided by LOCAL_SIZE, the ranks on this machine) minus 2,
    at least 1: one core for the training process launching kernels, one for the aio threads, the
    rest for CPU Adam, which otherwise binds the step (``worker_threads_for``)."""

    training_threads: Optional[int] = Field(None, ge=1)
    """Intra-op CPU threads of the training process (``torch.set_num_threads``, set at initialize and
    given back at ``engine.close()``). Default: the cores this rank may use (as for
    ``optimizer_worker_threads``) less the optimizer worker's threads, at least 1 (the same with the
    overlap off, so that both give the same bits); unless ``OMP_NUM_THREADS`` is set, which is then
    left as it is. On the CPU accelerator
    training computes on the cores the worker runs Adam on: torch's default (every core) has them
    spin against each other and against anything else on the machine (a data loader), which slowed
    a step 2.5x beside one busy core here (docs/ab_bench.md); with a GPU the training process only
    launches kernels (``training_threads_for``)."""

    collective_timeout_seconds: float = Field(600.0, gt=0)
    """How long a rank waits in a collective for the others before failing with an error (used when
    ds_greedysnake.initialize sets up torch.distributed; DeepSpeed's own default is 30 minutes)."""

    auto: bool = False
    """Plan at initialize (ds_greedysnake.planner, docs/planner.md): choose ``deferred_layers``,
    ``activation_host_memory_mb``, ``gradient_host_memory_mb`` and ``optimizer_host_memory_mb`` unless set
    here, and M (gradient_accumulation_steps) when ds_config
    fixes no batch size and one rank runs; the choices are logged. Built-in GPT models only."""

    plan_hardware: Optional[str] = None
    """With ``auto``: a hardware JSON file (configs/hardware/) instead of probing this machine."""

    plan_host_memory_gb: Optional[float] = Field(None, gt=0)
    """With ``auto``: the host-memory budget (GiB) of the plan; default half the machine's memory."""

    save_total_limit: Optional[int] = Field(None, ge=1)
    """Keep at most this many checkpoints in a ``save_checkpoint`` folder, as Hugging Face's
    ``save_total_limit`` does: after each save is published and ``latest`` has moved, the oldest
    checkpoints there beyond this number are removed, never the one ``latest`` names nor the one just
    saved (so with ``save_latest=False`` saves one more may stay). Only checkpoints of format 2 (this
    version's) count; other folders are never touched. None keeps them all. Under HF ``Trainer`` use
    ``TrainingArguments.save_total_limit``: it saves each checkpoint in a folder of its own."""

    swap_dir_name: str = "greedysnake"
    """Folder created under ``zero_optimization.offload_param.nvme_path`` for this run's files."""


def cores_per_rank() -> int:
    """The cores this process may run on (its CPU affinity) shared among the ranks on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks_here = max(1, int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return max(1, cores // ranks_here)


def worker_threads_for(config: GreedySnakeConfig, device_type: str) -> int:
    """``optimizer_worker_threads``, or its default for the accelerator (see the field)."""
    if config.optimizer_worker_threads is not None:
        return config.optimizer_worker_threads
    if device_type == "cpu":
        return 1
    return max(1, cores_per_rank() - 2)


def training_threads_for(config: GreedySnakeConfig, device_type: str) -> Optional[int]:
    """``training_threads``, or its default (see the field); None: leave torch's setting (OMP_NUM_THREADS set)."""
    if config.training_threads is not None:
        return config.training_threads
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    # Less the worker's threads even with the overlap off (Adam then runs here, elementwise, the same either
    # way): the thread count changes the bits of reductions, and overlap on and off give the same bits.
    return max(1, cores_per_rank() - worker_threads_for(config, device_type))


def parse_greedysnake_config(ds_config: Dict[str, Any]) -> GreedySnakeConfig:
    """Read the block, turning pydantic's validation error into one that names the key. Below
    ``initialize`` the block comes parsed, in ``settings.Settings.greedysnake``."""
    return parse_greedysnake_block(ds_config.get(GREEDYSNAKE_KEY, {}))


def parse_greedysnake_block(block: Any) -> GreedySnakeConfig:
    """The ``"greedysnake"`` block itself (``parse_greedysnake_config``)."""
    if not isinstance(block, dict):
        raise GreedySnakeConfigError(
            f'"{GREEDYSNAKE_KEY}" must be an object like {{"enabled": true}}, got {block!r}')
    try:
        return GreedySnakeConfig(**block)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
        known = ", ".join(GreedySnakeConfig.model_fields)
        raise GreedySnakeConfigError(
            f'invalid "{GREEDYSNAKE_KEY}" block {block!r}: {problems}. Known keys: {known}') from None


def check_ds_config(ds_config: Dict[str, Any], device_type: str) -> str:
    """Check that the DeepSpeed config is one the vertical engine runs; return the nvme path.

    The vertical engine replaces ZeRO-Infinity, so it needs the same description of it: ZeRO
    stage 3 with parameters and optimizer states on NVMe, and an optimizer from ds_config.
    """
    zero = ds_config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage != 3:
        raise GreedySnakeConfigError(
            f"greedysnake needs zero_optimization.stage 3 (ZeRO-Infinity), got stage {stage!r}: "
            'set "zero_optimization": {"stage": 3, ...}')
    param_path = _nvme_path(zero, "offload_param")
    optimizer_path = _nvme_path(zero, "offload_optimizer")
    if param_path != optimizer_path:
        raise GreedySnakeConfigError(
            f"offload_param.nvme_path ({param_path}) and offload_optimizer.nvme_path ({optimizer_path}) "
            "differ; greedysnake keeps one folder per run: use the same path for both")
    fp16 = (ds_config.get("fp16") or {}).get("enabled", False)
    if fp16 and device_type == "cpu":
        raise GreedySnakeConfigError(
            'fp16.enabled is true but the accelerator is the CPU, which has no fp16 training: '
            'use "bf16": {"enabled": true} or fp32')
    if fp16:
        raise GreedySnakeConfigError(
            "fp16 (with loss scaling) is not supported by greedysnake yet: use bf16 or fp32")
    optimizer = ds_config.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        raise GreedySnakeConfigError(
            f'greedysnake steps with DeepSpeedCPUAdam and needs "optimizer": {{"type": "AdamW", ...}} '
            f"in ds_config; got {optimizer.get('type')!r}")
    check_nvme_path(param_path)
    return param_path


def _nvme_path(zero: Dict[str, Any], section: str) -> str:
    offload = zero.get(section) or {}
    device = offload.get("device", "none")
    if device != "nvme":
        raise GreedySnakeConfigError(
            f'greedysnake needs zero_optimization.{section}.device "nvme", got {device!r}: '
            f'set "{section}": {{"device": "nvme", "nvme_path": "/path/on/ssd"}}')
    path = offload.get("nvme_path")
    if not path:
        raise GreedySnakeConfigError(
            f"zero_optimization.{section}.nvme_path is missing: name a folder on an SSD")
    return os.path.abspath(str(path))


def check_nvme_path(path: str) -> None:
    """Refuse a missing or unwritable folder, a RAM-backed one, or one without O_DIRECT."""
    if not os.path.isdir(path):
        raise GreedySnakeConfigError(
            f"nvme_path {path} does not exist or is not a folder: create it on an SSD (mkdir -p {path})")
    if not os.access(path, os.W_OK | os.X_OK):
        raise GreedySnakeConfigError(f"nvme_path {path} is not writable by this user: chmod it or pick another folder")
    filesystem = filesystem_type(path)
    if filesystem in _RAM_FILESYSTEMS:
        raise GreedySnakeConfigError(
            f"nvme_path {path} is on {filesystem}, which keeps every byte in RAM (and on many kernels has no "
            "direct I/O): put it on a disk-backed filesystem on an SSD")
    _probe_direct_io(path)


_RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path``, from the longest matching mount point."""
    real = os.path.realpath(path)
    best, best_type = "", "unknown"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                mount_point = fields[1].replace("\\040", " ")
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fields[2]
    except OSError:
        pass  # no /proc: the direct I/O probe still runs
    return best_type


def _probe_direct_io(path: str) -> None:
    """Write and read back one aligned block with O_DIRECT, as the aio op will."""
    block = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    block.write(b"greedysnake-probe".ljust(4096, b"."))
    descriptor, probe_path = None, None
    try:
        handle, probe_path = tempfile.mkstemp(prefix=".gs_direct_probe_", dir=path)
        os.close(handle)
        descriptor = os.open(probe_path, os.O_RDWR | os.O_DIRECT)
        written = os.pwrite(descriptor, block, 0)
        readback = mmap.mmap(-1, 4096)
        read = os.preadv(descriptor, [readback], 0)
        if written != 4096 or read != 4096 or readback[:17] != b"greedysnake-probe":
            raise OSError(errno.EIO, f"direct I/O probe wrote {written} and read {read} of 4096 bytes")
    except OSError as error:
        if error.errno == errno.EINVAL:
            raise GreedySnakeConfigError(
                f"nvme_path {path} is on a filesystem without direct I/O (O_DIRECT): put it on a "
                "disk-backed filesystem such as ext4 or xfs on an SSD") from None
        raise GreedySnakeConfigError(f"nvme_path {path} cannot be used for direct I/O: {error}") from None
    finally:
        if descriptor is not None:
            os.close(descriptor)
        if probe_path is not None and os.path.exists(probe_path):
            os.remove(probe_path)
