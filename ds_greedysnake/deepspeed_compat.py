"""The only module that touches DeepSpeed's private pieces.

Everything greedysnake needs from DeepSpeed beyond its public API goes through here: the engine
constructor hooks, the native ops (prebuilt at install, see ``native_ops_status``; an op DeepSpeed
builds at run time instead is logged), the async I/O op, the CPU Adam kernel and the ZeRO-Infinity
parameter swapper (for counting its reads in A/B comparisons). ``check_deepspeed_internals()`` fails
loudly, naming the attribute, when a DeepSpeed release drops one of them; a test calls it.
"""
import atexit
import contextlib
import ctypes
import functools
import os
import re
import resource
import sys
import tempfile
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.ops.op_builder.builder import OpBuilder
from deepspeed.runtime import constants as ds_constants
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.swap_tensor import partitioned_param_swapper
from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT, get_aio_config
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import groups, logger

from . import build_locks, prebuilt_ops

CHECKED_DEEPSPEED_VERSION = "0.19.8"

# (object, attribute) pairs this module relies on; check_deepspeed_internals() verifies them.
_RELIED_ON = [
    (DeepSpeedEngine, "_configure_optimizer"),
    (DeepSpeedEngine, "_configure_lr_scheduler"),
    (DeepSpeedEngine, "_broadcast_model"),
    (groups, "_get_broadcast_src_rank"),
    (DeepSpeedEngine, "_config"),
    (DeepSpeedCPUAdam, "ds_opt_adam"),
    (DeepSpeedCPUAdam, "opt_id"),
    (DeepSpeedCPUAdam, "optimizer_id"),
    (partitioned_param_swapper, "swap_in_tensors"),
    (OpBuilder, "jit_load"),
    (OpBuilder, "load"),
    (ds_constants, "GRADIENT_CLIPPING_DEFAULT"),
]


class DeepSpeedInternalsError(RuntimeError):
    """A DeepSpeed private attribute greedysnake relies on is gone."""


def check_deepspeed_internals() -> None:
    placeholder = DeepSpeedCPUAdam([torch.zeros(1)])
    for owner, attribute in _RELIED_ON:
        target = placeholder if owner is DeepSpeedCPUAdam else owner
        if attribute == "_config" and owner is DeepSpeedEngine:
            continue  # an instance attribute, set in DeepSpeedEngine.__init__; checked by use
        if not hasattr(target, attribute):
            raise DeepSpeedInternalsError(
                f"DeepSpeed {deepspeed.__version__} has no {getattr(owner, '__name__', owner)}.{attribute}; "
                f"ds_greedysnake was checked against DeepSpeed {CHECKED_DEEPSPEED_VERSION}: install that release")
    for op_name in ("adam_update", "create_adam"):
        if not hasattr(placeholder.ds_opt_adam, op_name):
            raise DeepSpeedInternalsError(f"DeepSpeed's cpu_adam op has no {op_name}")
    for name, (module_name, class_name, method) in _ZERO_PROFILED.items():  # the planner's ZeRO-3 profile
        if not hasattr(_zero_profiled_owner(module_name, class_name), method):
            raise DeepSpeedInternalsError(
                f"DeepSpeed {deepspeed.__version__} has no {class_name or module_name}.{method} (the planner's ZeRO-3 "
                f"profile times it as {name!r}); ds_greedysnake was checked against DeepSpeed {CHECKED_DEEPSPEED_VERSION}")


# ----------------------------------------------------------------------------- engine construction


def default_gradient_clipping() -> float:
    """What DeepSpeed clips at when ds_config has no "gradient_clipping" (1.0 in 0.19.8, 0 before)."""
    return float(ds_constants.GRADIENT_CLIPPING_DEFAULT)


# The zero_optimization fields the planner models ZeRO-Infinity with, by DeepSpeed's config field name.
ZERO_PLANNER_FIELDS = ("prefetch_bucket_size", "max_reuse_distance", "param_persistence_threshold",
                       "max_live_parameters", "reduce_bucket_size", "sub_group_size")


def zero_min_swap_bytes(aio: "AioSettings") -> int:
    """The smallest tensor, in bytes, ZeRO-3's swappers put on NVMe (``swappable_tensor``: at least DeepSpeed's
    MIN_AIO_BYTES, 1 MiB, and the aio block); smaller parameter tensors and optimizer sub-groups stay in host
    memory."""
    from deepspeed.runtime.swap_tensor.utils import MIN_AIO_BYTES

    return max(MIN_AIO_BYTES, aio.block_size)


def zero_planner_defaults() -> Dict[str, Tuple[str, float]]:
    """For each of ``ZERO_PLANNER_FIELDS``: its ds_config key (``stage3_...`` where DeepSpeed aliases it) and
    the default DeepSpeed's own ZeRO config model gives it when the key is absent."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    return {name: (fields[name].alias or name, float(fields[name].default)) for name in ZERO_PLANNER_FIELDS}


def parsed_ds_config(ds_config: Dict[str, Any], mpu=None) -> DeepSpeedConfig:
    """DeepSpeed's parsed config object, which its engine constructor takes beside the dict."""
    return DeepSpeedConfig(ds_config, mpu)


class EngineBase(DeepSpeedEngine):
    """DeepSpeed's engine with its model placement and optimizer construction handed to a subclass.

    DeepSpeed's constructor would wrap the model in ZeRO-3 (hooks that fetch a layer on every
    call, gradient hooks that reduce on every backward). The vertical engine owns those jobs, so
    the constructor keeps the model on the host and asks the subclass for the optimizer; all the
    rest (distributed set-up, config, lr scheduler from ds_config, timers, monitor) is DeepSpeed's.
    """

    def __init__(self, **kwargs):
        super().__init__(dont_change_device=True, **kwargs)

    def _broadcast_model(self):
        """Rank 0's weights to every rank, as DeepSpeed's constructor does for a model not built under
        zero.Init (which makes every rank start from the same model whatever its seed).

        The model stays on the host here (``dont_change_device``), and NCCL has no host backend: each
        parameter travels through the device in pieces of at most ``BROADCAST_PIECE_BYTES`` (device memory
        stays bounded by one piece, whatever the model) and comes back. On the CPU accelerator the device
        is the host, and this is DeepSpeed's own broadcast. (DeepSpeed's sends MoE experts over their own
        groups; greedysnake splits no MoE model.)"""
        if self.dist_backend is None or self.weights_come_from_files:
            return  # from files: the module holds empty placeholders, every rank reads the same files
        device = accelerator_device()
        if device.type == "cpu":
            super()._broadcast_model()
            return
        source = groups._get_broadcast_src_rank()
        for param in self.module.parameters():
            if is_zero3_parameter(param) and param.ds_status is not ZeroParamStatus.AVAILABLE:
                continue  # partitioned by zero.Init: each rank holds its own part
            broadcast_through_device(param.data, device, source, self.seq_data_parallel_group)

    def _configure_optimizer(self, client_optimizer, model_parameters):
        if client_optimizer is not None:
            raise ValueError("greedysnake builds its own layer-wise CPU Adam from the ds_config \"optimizer\" "
                             "block; pass optimizer=None to ds_greedysnake.initialize")
        self.optimizer = self.build_optimizer()
        self.basic_optimizer = self.optimizer

    def build_optimizer(self):
        raise NotImplementedError

    # The subclass says so when every rank reads the initial weights from the same files
    # (initialize(pretrained=...)): the module then holds empty placeholders, nothing to broadcast.
    weights_come_from_files = False


BROADCAST_PIECE_BYTES = 64 << 20


def broadcast_through_device(host: torch.Tensor, device: torch.device, source: int, group) -> None:
    """Broadcast a host tensor from rank ``source`` through ``device`` (collectives of NCCL take device
    tensors only), ``BROADCAST_PIECE_BYTES`` at a time, into ``host`` in place on the other ranks."""
    flat = host.view(-1).view(torch.uint8)  # a view: filled in place
    receiving = dist.get_rank() != source
    for start in range(0, flat.numel(), BROADCAST_PIECE_BYTES):
        piece = flat[start:start + BROADCAST_PIECE_BYTES]
        on_device = piece.to(device, copy=True)
        dist.broadcast(on_device, source, group=group)
        if receiving:
            piece.copy_(on_device)


@contextlib.contextmanager
def deepspeed_initialize_routed(route: Callable) -> Iterator[None]:
    """While the block runs, ``deepspeed.initialize(**kwargs)`` returns ``route(original, **kwargs)``.

    HF Trainer's engine is built by accelerate's ``Accelerator._prepare_deepspeed``, which looks
    ``deepspeed.initialize`` up at call time (accelerate 1.15): this is how GreedySnakeTrainer hands it
    the greedysnake engine without changing accelerate. ``route`` calls ``original`` for what it does
    not take over.
    """
    original = deepspeed.initialize

    def routed(*args, **kwargs):
        return route(original, *args, **kwargs)

    deepspeed.initialize = routed
    try:
        yield
    finally:
        deepspeed.initialize = original


# ----------------------------------------------------------------------------- models built under zero.Init


def is_zero3_parameter(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def logical_shape(param: torch.nn.Parameter) -> torch.Size:
    """The full shape, also for a parameter whose .data is an empty placeholder (zero.Init's partitions,
    greedysnake's own placeholders)."""
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


def mark_full_shape(param: torch.nn.Parameter, shape: torch.Size) -> None:
    """Record the full shape of a parameter about to hold an empty placeholder, where zero.Init records it."""
    param.ds_shape = torch.Size(shape)
    param.ds_numel = torch.Size(shape).numel()


def gathered(params):
    """Full weights of zero.Init parameters for the duration of the block (no-op for plain ones)."""
    partitioned = [p for p in params if is_zero3_parameter(p)]
    if not partitioned:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(partitioned)


def drop_zero3_partition(param: torch.nn.Parameter) -> None:
    """Free the ZeRO-3 partition once greedysnake holds the weights in its own SSD region.

    zero.Init also replaces torch.nn.functional.linear for good; its backward all-gathers any weight
    whose status says NOT_AVAILABLE. Greedysnake sets .data itself, so the status says AVAILABLE.
    """
    if not is_zero3_parameter(param):
        return
    partition = getattr(param, "ds_tensor", None)
    if partition is not None:
        partition.data = torch.empty(0, dtype=partition.dtype, device=partition.device)
    param.ds_status = ZeroParamStatus.AVAILABLE


# Far above the ids zero.Init hands out (a counter from 0), so the two never meet.
_GATHERABLE_ID_BASE = 1 << 40


def make_gatherable(shapes: Dict[torch.nn.Parameter, torch.Size], group, gather: Callable, release: Callable) -> None:
    """Let ``deepspeed.zero.GatheredParameters`` reach weights greedysnake keeps on SSD.

    DeepSpeed's context (0.19.8) acts on the parameters that have ``ds_id``: on entry it calls
    ``params[0].all_gather(param_list=...)``; on exit, after broadcasting from ``modifier_rank`` over
    each parameter's ``ds_process_group``, ``params[0].partition(param_list=..., has_been_updated=...)``.
    zero.Init gives its parameters these; the vertical engine owns the weights instead, so it gives
    every parameter its own (``gather(params)``, ``release(params, has_been_updated)``), and plain
    parameters the marks of a ZeRO-3 one (full shape and numel, as HF and PEFT count them).
    """
    for number, (param, shape) in enumerate(shapes.items()):
        if not is_zero3_parameter(param):
            param.ds_id = _GATHERABLE_ID_BASE + number
            mark_full_shape(param, shape)
            param.ds_process_group = group
        param.ds_status = ZeroParamStatus.AVAILABLE

        def all_gather(param_list=None, async_op=False, hierarchy=None, _param=param):
            gather(param_list if param_list is not None else [_param])

        def partition(param_list=None, hierarchy=None, has_been_updated=False, free_data=True, _param=param):
            release(param_list if param_list is not None else [_param], has_been_updated)

        param.all_gather, param.partition = all_gather, partition


# ----------------------------------------------------------------------------- native ops

# The ops a greedysnake or ZeRO-Infinity run loads: async I/O (which loads pin_memory first), CPU
# Adam and, on the CPU accelerator, the shared-memory collectives deepspeed.comm loads at init.
NATIVE_OPS = ("async_io", "pin_memory", "cpu_adam", "deepspeed_shm_comm")
_BUILDERS = {"async_io": "AsyncIOBuilder", "pin_memory": "PinMemoryBuilder", "cpu_adam": "CPUAdamBuilder",
             "deepspeed_shm_comm": "ShareMemCommBuilder"}
# Set (to 1) to make an op DeepSpeed would compile at run time an error instead (the test suite does).
REQUIRE_PREBUILT_OPS_ENV = "DS_GREEDYSNAKE_REQUIRE_PREBUILT_OPS"
SETUP_COMMAND = "bash scripts/setup.sh"


class NativeOpNotPrebuiltError(RuntimeError):
    """DeepSpeed would compile an op at run time, and REQUIRE_PREBUILT_OPS_ENV forbids it."""


# The ops the optimizer worker loads (updates.worker_main), on DeepSpeed's CPU accelerator whatever trains.
WORKER_OPS = ("pin_memory", "async_io", "cpu_adam")
WORKER_ACCELERATOR = "cpu"


def build_command(accelerator: str) -> str:
    """The set-up command that builds the ops for ``accelerator`` where DeepSpeed's install has none for it."""
    return f"python scripts/native_ops.py build --accelerator {accelerator}"


def current_accelerator() -> str:
    """The name DeepSpeed records an install under and compares at load: "cpu", "cuda", ..."""
    return get_accelerator()._name


def _installed_for(accelerator: str) -> Set[str]:
    """The ops compiled into the installed DeepSpeed that its load() imports under ``accelerator``."""
    from deepspeed.git_version_info import accelerator_name, installed_ops
    return {name for name, built in installed_ops.items() if built} if accelerator_name == accelerator else set()


def set_up_op(name: str, accelerator: str) -> Tuple[Optional[prebuilt_ops.BuiltOp], str]:
    """Op ``name`` as set-up built it for ``accelerator`` (prebuilt_ops), or None and why not."""
    op = prebuilt_ops.read(accelerator, name)
    if op is None:
        return None, f"set-up built none in {prebuilt_ops.folder(accelerator)}"
    mismatch = op.mismatch(deepspeed.__version__, torch.__version__)
    return (None, mismatch) if mismatch else (op, "")


def native_ops_status() -> Dict[str, bool]:
    """Each op of NATIVE_OPS this accelerator has, and whether it loads without compiling.

    DeepSpeed loads a prebuilt op only when its install recorded it (``DS_BUILD_<OP>=1`` at install)
    for the accelerator running now; otherwise it JIT-compiles the op into TORCH_EXTENSIONS_DIR, unless
    set-up built it for this accelerator (``prebuilt_ops``: the worker's CPU ops beside a GPU install)."""
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    accelerator = current_accelerator()
    installed = _installed_for(accelerator)
    return {name: name in installed or set_up_op(name, accelerator)[0] is not None
            for name in NATIVE_OPS if name in ALL_OPS}


def missing_worker_ops() -> Dict[str, str]:
    """The ops the optimizer worker would have to compile (op -> why), checked from any process: neither
    compiled into DeepSpeed's install for the CPU accelerator nor built by set-up for it."""
    installed = _installed_for(WORKER_ACCELERATOR)
    missing = {}
    for name in WORKER_OPS:
        if name not in installed:
            op, why = set_up_op(name, WORKER_ACCELERATOR)
            if op is None:
                missing[name] = why
    return missing


def check_worker_ops() -> None:
    """Raises NativeOpNotPrebuiltError, naming the set-up command, if the worker would compile an op.

    Training on a GPU, the worker runs on DeepSpeed's CPU accelerator, and DeepSpeed's install (made
    under the GPU's) has no op for it: it would compile cpu_adam and async_io at its first start (g++,
    ninja, libaio, minutes of every core, against the worker's start timeout)."""
    missing = missing_worker_ops()
    if missing:
        from deepspeed.git_version_info import accelerator_name
        reasons = "; ".join(f"{name}: {why}" for name, why in missing.items())
        raise NativeOpNotPrebuiltError(
            f"the greedysnake optimizer worker runs on DeepSpeed's CPU accelerator, and DeepSpeed was installed "
            f"for {accelerator_name or 'no accelerator'}: its ops {', '.join(missing)} are not prebuilt for the CPU "
            f"accelerator ({reasons}). Run `{build_command(WORKER_ACCELERATOR)}` (`{SETUP_COMMAND}` does) to build "
            f"them once into {prebuilt_ops.folder(WORKER_ACCELERATOR)}")


def native_op_compatible(name: str, verbose: bool = False) -> bool:
    """Whether DeepSpeed can build op ``name`` here (with ``verbose``, it prints what is missing)."""
    return bool(get_accelerator().create_op_builder(_BUILDERS[name]).is_compatible(verbose))


def load_native_op(name: str):
    """DeepSpeed's op module ``name`` (one of NATIVE_OPS): the prebuilt one, else compiled now (logged)."""
    return get_accelerator().create_op_builder(_BUILDERS[name]).load(verbose=False)


def _reported_jit_load(jit_load):
    """DeepSpeed's OpBuilder.jit_load (reached only for an op that is not prebuilt), made loud: it says
    that it compiles and where, clears a build lock its dead owner left (torch would wait on it forever,
    silently), names the process behind a live one while it waits, and raises under
    REQUIRE_PREBUILT_OPS_ENV."""

    @functools.wraps(jit_load)
    def reported(builder, verbose=True):
        if os.environ.get(REQUIRE_PREBUILT_OPS_ENV, "0") not in ("", "0"):
            raise NativeOpNotPrebuiltError(
                f"DeepSpeed's {builder.name} op is not prebuilt in {os.path.dirname(deepspeed.__file__)} and "
                f"{REQUIRE_PREBUILT_OPS_ENV}=1 forbids compiling it at run time: run `{SETUP_COMMAND}` (it installs "
                f"DeepSpeed with its native ops compiled in; where the install was made for another accelerator, "
                f"`{build_command(current_accelerator())}` builds them into "
                f"{prebuilt_ops.folder(current_accelerator())}), or unset {REQUIRE_PREBUILT_OPS_ENV} to compile it now")
        build_folder = os.path.join(build_locks.extensions_root(), builder.name)
        logger.warning(f"ds_greedysnake: DeepSpeed's {builder.name} op is not prebuilt in this install: DeepSpeed "
                       f"builds it at run time in {build_folder} (minutes of every core the first time, and again "
                       f"whenever its compile flags differ). `{SETUP_COMMAND}` installs DeepSpeed with its native ops "
                       "compiled in, once")
        build_locks.wait_until_free(os.path.join(build_folder, build_locks.LOCK_NAME),
                                    lambda line: logger.warning(f"ds_greedysnake: {line}"))
        return jit_load(builder, verbose)

    reported.ds_greedysnake_reported = True
    return reported


# Ops imported from set-up's folder, by name (one accelerator per process, as DeepSpeed's own cache).
_SET_UP_MODULES: Dict[str, ModuleType] = {}


def _set_up_module(name: str) -> Optional[ModuleType]:
    """Op ``name`` from the ops set-up built for this accelerator, where DeepSpeed's install has none for it."""
    if name in _SET_UP_MODULES:
        return _SET_UP_MODULES[name]
    accelerator = current_accelerator()
    if name in _installed_for(accelerator):
        return None  # DeepSpeed's own import
    op, _ = set_up_op(name, accelerator)
    if op is None:
        return None
    _SET_UP_MODULES[name] = module = prebuilt_ops.import_built(op)
    return module


def _set_up_aware_load(load):
    """DeepSpeed's OpBuilder.load (the installed op if made for this accelerator, else jit_load), looking
    first at the ops set-up built for this accelerator. Every load goes through it, DeepSpeed's own too
    (DeepSpeedCPUAdam, the swapper's aio handles): AsyncIOBuilder and PinMemoryBuilder reach it by super()."""

    @functools.wraps(load)
    def set_up_aware(builder, verbose=False):
        module = _set_up_module(builder.name)
        return module if module is not None else load(builder, verbose)

    set_up_aware.ds_greedysnake_set_up_aware = True
    return set_up_aware


def _report_jit_builds() -> None:
    if not getattr(OpBuilder.jit_load, "ds_greedysnake_reported", False):
        OpBuilder.jit_load = _reported_jit_load(OpBuilder.jit_load)
    if not getattr(OpBuilder.load, "ds_greedysnake_set_up_aware", False):
        OpBuilder.load = _set_up_aware_load(OpBuilder.load)


_report_jit_builds()


def build_for_set_up(names: Sequence[str]) -> List[prebuilt_ops.BuiltOp]:
    """Compiles ops ``names`` for the accelerator running now with DeepSpeed's own JIT build (its files and
    flags, as at run time) into ``prebuilt_ops.folder``, and records each; torch's build skips an op whose
    sources and flags did not change. For set-up only (scripts/native_ops.py build)."""
    accelerator = current_accelerator()
    target = prebuilt_ops.folder(accelerator)
    jit_load = getattr(OpBuilder.jit_load, "__wrapped__", OpBuilder.jit_load)  # not the run-time warning
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = target  # torch reads it at each build
    saved_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    readable = None if saved_arch_list is None else builder_arch_list(saved_arch_list)
    if readable != saved_arch_list:
        os.environ["TORCH_CUDA_ARCH_LIST"] = readable
        logger.warning(f"ds_greedysnake: TORCH_CUDA_ARCH_LIST={saved_arch_list!r} is read as {readable!r} for "
                       "DeepSpeed's op build (its parser takes no architecture suffix such as 9.0a)")
    built = []
    try:
        for name in names:
            if name == "async_io":  # it resolves pin_memory's symbols at import: that one first, made global
                load_native_op("pin_memory")
            builder = get_accelerator().create_op_builder(_BUILDERS[name])
            build_locks.wait_until_free(os.path.join(target, name, build_locks.LOCK_NAME),
                                        lambda line: logger.warning(f"ds_greedysnake: {line}"))
            module = jit_load(builder, False)
            op = prebuilt_ops.BuiltOp(name=name, module=module.__name__, file=os.path.abspath(module.__file__),
                                      deepspeed=deepspeed.__version__, torch=torch.__version__,
                                      python=sys.implementation.cache_tag)
            prebuilt_ops.record(accelerator, op)
            _SET_UP_MODULES[name] = module
            built.append(op)
    finally:
        for variable, value in (("TORCH_EXTENSIONS_DIR", saved), ("TORCH_CUDA_ARCH_LIST", saved_arch_list)):
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
    return built


_ARCH = re.compile(r"^(\d+)\.(\d+)[a-z]?(\+PTX)?$")


def builder_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19.8's op builder can read it. Its ``compute_capability_args``
    parses every part of an entry as an integer, so torch's architecture-specific entries ("9.0a", which
    the GPU machine's image sets, or "10.0f") abort every CUDA op build with a ValueError; the builder then
    compiles for the numeric architecture ("9.0"). Entries it cannot read at all are left for it to refuse."""
    entries = []
    for entry in value.replace(" ", ";").split(";"):
        entry = entry.strip()
        match = _ARCH.match(entry)
        if match:
            entry = f"{match.group(1)}.{match.group(2)}{match.group(3) or ''}"
        if entry and entry not in entries:
            entries.append(entry)
    return ";".join(entries)


_FLAVOUR_LINE = re.compile(r"is created with (\S+) arithmetic capability")


def cpu_adam_simd_flavour() -> str:
    """The SIMD flavour ("AVX512", "AVX2", "scalar", ...) the loaded cpu_adam op was compiled for, as the
    kernel reports it when it creates an optimizer (a line printed from C, read back from fd 1)."""
    module = load_native_op("cpu_adam")
    probe_id = DeepSpeedCPUAdam.optimizer_id  # claim an id no DeepSpeedCPUAdam uses
    DeepSpeedCPUAdam.optimizer_id += 1
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved_stdout = os.dup(1)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 1)
        try:
            module.create_adam(probe_id, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
            libc.fflush(None)
        finally:
            os.dup2(saved_stdout, 1)
            os.close(saved_stdout)
            module.destroy_adam(probe_id)
        capture.seek(0)
        printed = capture.read().decode(errors="replace")
    match = _FLAVOUR_LINE.search(printed)
    if match is None:
        raise RuntimeError(f"DeepSpeed's cpu_adam op did not report its SIMD flavour; it printed: {printed!r}")
    return match.group(1)


# ----------------------------------------------------------------------------- async I/O


_AIO_DEFAULTS = dict(AIO_DEFAULT_DICT)  # DeepSpeed's defaults for a config without an "aio" block


@dataclass(frozen=True)
class AioSettings:
    """The ds_config ``aio`` block, DeepSpeed's defaults filled in: what every aio handle is made with."""
    block_size: int = _AIO_DEFAULTS["block_size"]
    queue_depth: int = _AIO_DEFAULTS["queue_depth"]
    intra_op_parallelism: int = _AIO_DEFAULTS["intra_op_parallelism"]
    single_submit: bool = _AIO_DEFAULTS["single_submit"]
    overlap_events: bool = _AIO_DEFAULTS["overlap_events"]
    use_gds: bool = _AIO_DEFAULTS["use_gds"]

    def as_dict(self) -> Dict[str, Any]:
        """In DeepSpeed's key order (the planner's probe notes print it)."""
        return {key: getattr(self, key) for key in _AIO_DEFAULTS}


def aio_settings(ds_config: Dict[str, Any]) -> AioSettings:
    """The ds_config ``aio`` block parsed by DeepSpeed (its defaults filled in); called once, by
    ``settings.settings_from_ds_config``."""
    parsed = get_aio_config(ds_config)
    return AioSettings(**{key: parsed[key] for key in _AIO_DEFAULTS})


def new_aio_handle(aio: AioSettings):
    module = load_native_op("async_io")
    return module.aio_handle(aio.block_size, aio.queue_depth, aio.single_submit, aio.overlap_events,
                             aio.intra_op_parallelism)


# ----------------------------------------------------------------------------- CPU Adam


@dataclass
class AdamHyperparameters:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool = True


class CpuAdamKernel:
    """DeepSpeedCPUAdam's vectorised update, applied to flat fp32 tensors we own.

    DeepSpeedCPUAdam keeps its state per nn.Parameter in host memory; greedysnake keeps each layer's
    master weights and moments on SSD and streams them through, so it calls the same kernel directly
    with the step count of the iteration being applied.
    """

    def __init__(self, hyper: AdamHyperparameters, adamw_mode: bool):
        self._optimizer = DeepSpeedCPUAdam([torch.zeros(1)], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2),
                                           eps=hyper.eps, weight_decay=hyper.weight_decay,
                                           adamw_mode=adamw_mode, bias_correction=hyper.bias_correction)

    def replay_steps(self, last_step: int, hyper: AdamHyperparameters) -> None:
        """Bring the kernel's bias-correction state to ``last_step`` the way training would have.

        The kernel keeps beta^step from call to call, multiplying by beta when the step grows by one
        and calling pow() otherwise; the two differ in the last bit. A resumed run replays steps
        1..last_step on a one-element scratch tensor, so its next update is bitwise that of a run
        that never stopped.
        """
        scratch = [torch.zeros(1) for _ in range(4)]
        for step in range(1, last_step + 1):
            self.update(step, hyper, *scratch)

    def update(self, step: int, hyper: AdamHyperparameters, params: torch.Tensor, grads: torch.Tensor,
               exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        self._optimizer.ds_opt_adam.adam_update(self._optimizer.opt_id, step, hyper.lr, hyper.beta1, hyper.beta2,
                                                hyper.eps, hyper.weight_decay, hyper.bias_correction, params,
                                                grads, exp_avg, exp_avg_sq)


# ----------------------------------------------------------------------------- ZeRO-Infinity accounting


@dataclass
class SwapReadCounter:
    reads: int = 0
    bytes: int = 0
    sizes: List[int] = field(default_factory=list)   # each read's bytes
    call_bytes: List[int] = field(default_factory=list)  # each swap_in_tensors call's bytes (one swap_in's)


@contextlib.contextmanager
def count_zero_param_swap_reads() -> Iterator[SwapReadCounter]:
    """Count the NVMe reads ZeRO-Infinity's parameter swapper issues while the block runs."""
    counter = SwapReadCounter()
    original = partitioned_param_swapper.swap_in_tensors

    def counting_swap_in(handle, buffers, paths):
        counter.reads += len(buffers)
        sizes = [buffer.numel() * buffer.element_size() for buffer in buffers]
        counter.bytes += sum(sizes)
        counter.sizes.extend(sizes)
        counter.call_bytes.append(sum(sizes))
        return original(handle, buffers, paths)

    partitioned_param_swapper.swap_in_tensors = counting_swap_in
    try:
        yield counter
    finally:
        partitioned_param_swapper.swap_in_tensors = original


# What a profile of ZeRO-Infinity's step times (the planner's terms; docs/planner.md, "The planner on shapes it
# never ran on"): name -> (the module, the class or None for a function of the module, the method or
# function). Inclusive wall seconds: the reduction holds its reduce-scatter (the bucket flattened, divided and
# reduce-scattered) and its partition (each gradient's partition copied or added into its buffer, and at the
# boundary its norm and the gradient write); the optimizer step holds every other optimizer row.
_ZERO_PROFILED = {
    "parameter read": ("deepspeed.runtime.swap_tensor.partitioned_param_swapper", "AsyncPartitionedParameterSwapper",
                       "swap_in"),
    "parameter read wait": ("deepspeed.runtime.swap_tensor.partitioned_param_swapper",
                            "AsyncPartitionedParameterSwapper", "synchronize_reads"),
    "gradient reduction": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
                           "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"),
    "gradient write (boundary)": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
                                  "_swap_out_offload_fp32_gradients"),
    # The reduction's parts (scripts/bench/zero_reduction_profile.py): stage 3 calls the function by the name
    # it imported, so its module's name is the one wrapped.
    "gradient reduce-scatter": ("deepspeed.runtime.zero.stage3", None, "reduce_scatter_coalesced"),
    "gradient partition": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "partition_grads"),
    "gradient norm (boundary)": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
                                 "_constant_buffered_norm2"),
    "optimizer step": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "step"),
    "optimizer state read": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
                             "_optimizer_states_and_gradient_swap_in"),
    "Adam": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_optimizer_step"),
    "parameter write": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
                        "_reassign_or_swap_out_partitioned_parameters"),
    "optimizer state write": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
                              "_optimizer_states_and_gradient_swap_out"),
}


def _zero_profiled_owner(module_name: str, class_name: Optional[str]):
    """What holds a profiled method: the class, or the module itself for a function (None where absent)."""
    import importlib
    module = importlib.import_module(module_name)
    return module if class_name is None else getattr(module, class_name, None)


@dataclass
class ZeroProfile:
    """Wall seconds and calls of each of ``_ZERO_PROFILED``'s methods while the block ran; ``durations``: each
    call's seconds, in order."""
    seconds: Dict[str, float]
    calls: Dict[str, int]
    durations: Dict[str, List[float]]


@contextlib.contextmanager
def profile_zero_step() -> Iterator[ZeroProfile]:
    """Time ZeRO-3's parameter swap-ins, gradient reduction (and its parts) and the optimizer step's parts
    (state reads, Adam, parameter and state writes) while the block runs: the profile the planner's ZeRO-Infinity
    terms are checked against (scripts/bench/ab_bench). On the CPU accelerator every part but the aio
    reads in flight is synchronous, so wall seconds are the part's cost."""
    import time

    profile = ZeroProfile({name: 0.0 for name in _ZERO_PROFILED}, {name: 0 for name in _ZERO_PROFILED},
                          {name: [] for name in _ZERO_PROFILED})
    restore = []
    for name, (module_name, class_name, method) in _ZERO_PROFILED.items():
        owner = _zero_profiled_owner(module_name, class_name)
        original = getattr(owner, method)

        def timed(*args, _original=original, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                profile.seconds[_name] += elapsed
                profile.calls[_name] += 1
                profile.durations[_name].append(elapsed)

        setattr(owner, method, timed)
        restore.append((owner, method, original))
    try:
        yield profile
    finally:
        for owner, method, original in reversed(restore):
            setattr(owner, method, original)


@contextlib.contextmanager
def time_engine_phases(engine, seconds: Dict[str, float], micro_batches: int) -> Iterator[None]:
    """Add to ``seconds`` the wall seconds of a DeepSpeed engine's forwards, backwards and steps while the
    block runs, the boundary's backward and step (every ``micro_batches``-th: they write the gradients and
    run the optimizer) under their own names, by wrapping the engine's own methods for the block."""
    import time

    calls = {"backward": 0, "step": 0}

    def timed(name, original):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                key = name
                if name in calls:
                    calls[name] += 1
                    key = f"{name} (boundary)" if calls[name] % micro_batches == 0 else name
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - started
        return run

    names = ("forward", "backward", "step")
    for name in names:
        setattr(engine, name, timed(name, getattr(engine, name)))
    try:
        yield
    finally:
        for name in names:
            delattr(engine, name)


def zero_checkpointed_gpt(modules: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """[embedding, blocks..., head] with DeepSpeed's activation checkpointing around each block, the
    ZeRO-Infinity baseline that recomputes in backward as greedysnake does (call
    ``deepspeed.checkpointing.configure`` first). torch.utils.checkpoint gives wrong gradients with NVMe
    parameters on DeepSpeed 0.19.8 (docs/zero_infinity.md)."""

    class CheckpointedGPT(torch.nn.Sequential):
        def forward(self, token_ids):
            hidden = self[0](token_ids)
            for block in list(self)[1:-1]:
                hidden = deepspeed.checkpointing.checkpoint(block, hidden)
            return self[-1](hidden)

    return CheckpointedGPT(*modules)


def remove_shm_buffer_at_exit() -> None:
    """Remove, when this process exits, the ~69 MB /dev/shm buffer DeepSpeed's CPU comm op made for it.

    The op (csrc/cpu/comm/shm.cpp) names it deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    and never unlinks it; a few hundred runs fill the machine's RAM. Unlinking while other ranks
    still map it is safe: mappings outlive the name.
    """
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{os.environ.get('RANK', '0')}")

    def remove() -> None:
        try:
            os.remove(name)
        except OSError:
            pass

    atexit.register(remove)


def accelerator_device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def zero_swap_buffer(handle, num_bytes: int) -> torch.Tensor:
    """A uint8 host buffer as ZeRO-3's swappers allocate theirs (partitioned_param_swapper.py and
    ``SwapBufferManager``: page-locked by the aio handle, on every accelerator but GDS): the planner's probe
    times ZeRO-3's ops into it. Free it with ``handle.free_cpu_locked_tensor``."""
    _check_memlock(num_bytes)
    buffer = handle.new_cpu_locked_tensor(num_bytes, torch.empty(0, dtype=torch.uint8))
    if buffer.data_ptr() == 0:
        raise MemoryError(f"DeepSpeed's aio handle could not lock {num_bytes} bytes of host memory (mlock): "
                          "raise the memlock limit (ulimit -l unlimited)")
    return buffer


def new_locked_buffer(handle, num_bytes: int) -> Optional[torch.Tensor]:
    """A page-aligned uint8 host buffer locked by ``handle``'s pinned-tensor manager, or None where the
    accelerator pins memory itself: there, use ``transfers.host_buffer`` (registered with the accelerator
    at its exact size, so that device copies from it run asynchronously, and pinned as far as aio is
    concerned, which then reads into it directly).

    On the CPU accelerator torch cannot pin, and DeepSpeed's aio op then copies every transfer through
    a freshly allocated and mlocked bounce buffer: measured here, a 256 MiB read cost 0.87 s of CPU
    for 0.49 s of wall time, taken from the training threads. Buffers the handle locked itself (and
    slices of them) go to the SSD directly."""
    if get_accelerator().device_name() != "cpu":
        return None
    _check_memlock(num_bytes)
    buffer = handle.new_cpu_locked_tensor(num_bytes, torch.empty(0, dtype=torch.uint8))
    if buffer.data_ptr() == 0:
        raise MemoryError(f"DeepSpeed's aio handle could not lock {num_bytes} bytes of host memory (mlock): "
                          "raise the memlock limit (ulimit -l unlimited, or LimitMEMLOCK in systemd / "
                          "--ulimit memlock=-1 in docker)")
    return buffer


def free_locked_buffer(handle, buffer: torch.Tensor) -> None:
    handle.free_cpu_locked_tensor(buffer)


def _check_memlock(num_bytes: int) -> None:
    """mlock beyond RLIMIT_MEMLOCK fails inside DeepSpeed's op with only a line on stderr: say it here."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if os.geteuid() == 0 or soft == resource.RLIM_INFINITY or num_bytes <= soft:
        return  # root has CAP_IPC_LOCK in the usual set-ups
    raise MemoryError(f"greedysnake needs to lock {num_bytes} bytes of host memory for SSD transfers, but the "
                      f"memlock limit is {soft} bytes: raise it (ulimit -l unlimited, or --ulimit memlock=-1 in "
                      "docker)")
