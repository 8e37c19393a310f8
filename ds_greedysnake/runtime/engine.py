"""The vertical engine: DeepSpeed's engine whose training step is the GreedySnake schedule."""
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from .activations import ActivationStore
from ..storage.checkpoint import restore_checkpoint, write_checkpoint
from ..config import training_threads_for, worker_threads_for
from ..deepspeed_compat import EngineBase, accelerator_device
from .executor import Executor, StepResult
from ..models.export import write_hf_checkpoint, write_peft_adapters
from ..storage.io_trace import IoTrace
from .layer import BufferPool, LayerOwner, Residency
from ..models.micro_batch import check_inputs, to_device, token_count
from .parallel import DataParallel
from ..models.model_split import peft_base_model, plan_split
from .optimizer import LayerwiseAdam, OptimizerSettings
from ..models.pretrained import PretrainedWeights
from ..settings import Settings
from ..storage.ssd import IoCounters, SsdStore, SwapFolderLock
from ..models.weights import LayerParams, LayerSource, ModuleWeightAccess, WeightPlan, as_dtype
from ..models.zero_to_fp32 import describe_weights


@dataclass
class StepMetrics:
    """What one train_batch did, for logs and benchmarks."""
    step: int
    loss: float
    tokens: int
    seconds: float
    ssd_bytes_read: Dict[str, int]
    ssd_bytes_written: Dict[str, int]
    ssd_reads: Dict[str, int]
    seconds_by_op: Dict[str, float]
    global_grad_norm: float
    skipped: bool
    optimizer_seconds: float       # Adam updates that finished during this step (wherever they ran)
    optimizer_wait_seconds: float  # time training was blocked on them

    @property
    def optimizer_hidden_share(self) -> float:
        """Share of the optimizer time that ran while training went on."""
        if self.optimizer_seconds <= 0:
            return float("nan")
        return max(0.0, 1.0 - self.optimizer_wait_seconds / self.optimizer_seconds)

    @property
    def compute_seconds(self) -> float:
        return sum(self.seconds_by_op.get(kind, 0.0) for kind in ("forward", "backward", "loss_backward"))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


class ShortDataError(ValueError):
    """The data iterator ran out in the middle of a step: nothing of that step was run."""


def short_data_error(arrived: int, wanted: int, from_config: bool) -> Exception:
    """A clean end of the data (nothing arrived) stays a StopIteration, so loops that end on it still do;
    a part of a step is an error naming the counts (the step is not run: nothing of it is left behind)."""
    source = f"gradient_accumulation_steps is {wanted}" if from_config else f"num_micro_batches is {wanted}"
    if arrived == 0:
        return StopIteration(f"the data iterator is exhausted: no micro-batch arrived for the next step ({source})")
    return ShortDataError(
        f"the data iterator ran out after {arrived} of a step's micro-batches ({source}): the step was not run and "
        f"nothing changed. Give every step {wanted} micro-batches (e.g. DataLoader(drop_last=True) with a length "
        f"divisible by {wanted}), or train the last, short window with train_batch(data_iter, "
        f"num_micro_batches={arrived})")


class _Setup:
    """Arguments the subclass needs inside DeepSpeed's constructor (kept off nn.Module attributes)."""

    def __init__(self, settings: Settings, loss_fn: Callable, nvme_path: str,
                 pretrained: Optional[PretrainedWeights] = None):
        self.settings, self.config = settings, settings.greedysnake
        self.loss_fn, self.nvme_path = loss_fn, nvme_path
        self.pretrained = pretrained  # initial weights from a pretrained folder instead of the module's


class GreedySnakeEngine(EngineBase):

    def __init__(self, settings: Settings, loss_fn: Callable, nvme_path: str,
                 pretrained: Optional[PretrainedWeights] = None, **ds_kwargs):
        """``settings``: the ds_config parsed once by ``initialize``; ``ds_kwargs`` DeepSpeed's engine's
        (with the ds_config dict, which only DeepSpeed's constructor reads)."""
        self._setup = _Setup(settings, loss_fn, nvme_path, pretrained)
        self.settings = settings
        # What this engine opens (the swap folder's lock, aio handles and locked buffers, the optimizer worker
        # and its shared memory), closed in reverse order by ``close``, or at once when the constructor fails:
        # a script that catches the failure and retries elsewhere leaks nothing.
        self._opened = contextlib.ExitStack()
        self.io_counters = IoCounters()
        self.last_step_metrics: Optional[StepMetrics] = None
        # Per micro-batch of the last train_batch or eval_batch, what loss_fn returned beside the loss
        # (micro_batch.LossWithMetrics), each value summed over the ranks.
        self.last_micro_batch_metrics: List[Dict[str, float]] = []
        try:
            super().__init__(**ds_kwargs)
            self._install_weight_access()
        except BaseException:
            self._release_after_failed_start()
            raise

    def _release_after_failed_start(self) -> None:
        try:
            self._opened.close()
        except Exception as error:  # the constructor's own error is the one to see
            logger.warning(f"greedysnake: releasing what a failed initialize opened raised {error!r}")

    # Called by DeepSpeed's constructor once the model is placed and cast.
    def build_optimizer(self) -> LayerwiseAdam:
        setup = self._setup
        self.compute_dtype = torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        accumulate_dtype = torch.float32 if setup.config.fp32_grad_accumulation else self.compute_dtype
        device = accelerator_device()
        self._budget_training_threads(device.type)
        folder = os.path.join(setup.nvme_path, setup.config.swap_dir_name, f"rank{self.global_rank}")
        self.swap_folder = folder
        self.swap_lock = SwapFolderLock(folder)
        self._opened.callback(self.swap_lock.release)
        split = plan_split(self.module)
        self.parallel = DataParallel(self.dp_world_size, dist.get_rank(group=self.data_parallel_group), device,
                                     self.data_parallel_group)
        self.layers = [LayerOwner(index, module, self.compute_dtype, device, self.parallel, split.borrowed_by(index))
                       for index, module in enumerate(split.layers)]
        self._lend_tied_parameters(split)
        # The side inputs a micro-batch may carry (micro_batch.py): those some layer reads.
        self._readable_side_inputs = frozenset(name for module in split.layers
                                               for name in getattr(module, "side_inputs", ()))
        prefetch_depth = setup.config.prefetch_depth if setup.config.prefetch else 1
        param_store, optimizer_store, activation_store = (
            self._open_store(folder, name, handles) for name, handles in
            (("param", prefetch_depth), ("optimizer", 1), ("activation", 1)))
        num_layers = len(self.layers)
        deferred = setup.config.deferred_layers
        if deferred is not None and deferred > num_layers:
            raise ValueError(f"greedysnake.deferred_layers ({deferred}) exceeds the model's {num_layers} layers: "
                             f"use at most {num_layers}, or leave it unset")
        overlap = setup.config.optimizer_overlap
        clipping = float(self.gradient_clipping() or 0.0)
        # Plans every SSD region, logs their bytes and checks the disk holds them before creating any.
        settings = OptimizerSettings.from_settings(setup.settings, clipping, self.compute_dtype, accumulate_dtype,
                                                   num_layers, worker_threads_for(setup.config, device.type))
        optimizer = LayerwiseAdam(self.layers, optimizer_store, settings, self.parallel)
        self._opened.callback(optimizer.close)
        # The layer computing and the ones being prefetched (with prefetch off, a fetch still needs two
        # at the turn, where layer L-2 stays with the head); one more for a lender resident with its
        # borrower (tied embeddings: layer 0 stays with the head). Off the CPU one more again: a buffer is
        # free once its copy to the device has run, and the read that takes it next starts right after the
        # copy of the buffer given back last is enqueued; with a spare, that read takes the one given back a
        # layer before, whose copy has run, instead of waiting on the host for the one just enqueued.
        spare = 0 if self.layers[0].transfers.device_is_host else 1
        pool = BufferPool(param_store, max(layer.read_buffer_bytes for layer in self.layers),
                          count=1 + prefetch_depth + (1 if split.ties else 0) + spare)
        for layer in self.layers:
            trainable, frozen = self._initial_flat_weights(layer)
            shard = layer.layout.own_shard(trainable)
            layer.offload(param_store, pool, shard, optimizer.layout.layers[layer.index],
                          layer.frozen_layout.own_shard(frozen))
            optimizer.initialise_layer(layer, shard.float())
        budget = int(setup.config.activation_host_memory_mb * 2**20)
        self.activations = ActivationStore(activation_store, budget, device, num_layers - 1,
                                           self.gradient_accumulation_steps())
        self.executor = Executor(self.layers, self.activations, optimizer, setup.loss_fn, accumulate_dtype,
                                 setup.config.prefetch, overlap, deferred, prefetch_depth)
        # One recorder for this process (start_io_trace): its stores, the schedule's ops, the worker's pipes.
        self._io_recorder = optimizer.updater.recorder
        for store in (param_store, optimizer_store, activation_store):
            store.recorder = self._io_recorder
        self.executor.recorder = self._io_recorder
        return optimizer

    def _budget_training_threads(self, device_type: str) -> None:
        """This process's intra-op threads from the rank's cores (config.training_threads); given back on close."""
        threads = training_threads_for(self._setup.config, device_type)
        previous = torch.get_num_threads()
        if threads is None or threads == previous:
            return
        torch.set_num_threads(threads)
        self._opened.callback(torch.set_num_threads, previous)
        if self.global_rank == 0:
            logger.info(f"greedysnake: {threads} intra-op training threads (torch had {previous}; "
                        "greedysnake.training_threads)")

    def _open_store(self, folder: str, name: str, read_handles: int) -> SsdStore:
        store = SsdStore(folder, self.settings.aio, self.io_counters, name, read_handles=read_handles)
        self._opened.callback(store.close)
        return store

    def _initial_flat_weights(self, layer: LayerOwner):
        """The layer's trainable and frozen weights, each as one flat host vector in the compute dtype."""
        if self._setup.pretrained is None:
            return layer.flat_parameters()
        return tuple(self._setup.pretrained.flat_weights(params, self.compute_dtype)
                     for params in (layer.params, layer.frozen_params))

    @property
    def weights_come_from_files(self) -> bool:
        return self._setup.pretrained is not None

    def _lend_tied_parameters(self, split) -> None:
        # Across ranks too: every rank fetches the lender with the borrower at the same point of the
        # schedule (one more all-gather of layer 0), and the borrower's gradient goes into the lender's
        # accumulator, reduce-scattered once with it.
        for layer in self.layers:
            layer.lenders = [self.layers[lender] for lender in split.lenders_of(layer.index)]

    def train_batch(self, data_iter: Iterator, num_micro_batches: Optional[int] = None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches from ``data_iter``, or over
        ``num_micro_batches`` of them (the same on every rank): a shorter window, such as the last one of
        an epoch under HF Trainer. The loss is averaged over the micro-batches taken."""
        micro_batches = self._next_micro_batches(data_iter, num_micro_batches)
        before = self.io_counters.snapshot()
        updater = self.optimizer.updater
        update_seconds_before, wait_seconds_before = updater.update_seconds, updater.wait_seconds
        started = time.perf_counter()
        result = self.executor.run_step(micro_batches)
        seconds = time.perf_counter() - started
        result.optimizer_seconds = updater.update_seconds - update_seconds_before
        result.optimizer_wait_seconds = updater.wait_seconds - wait_seconds_before
        if result.decision.skipped:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.dp_world_size * len(micro_batches)
        mean_loss = self._mean_over_ranks(result.losses)
        self.last_micro_batch_metrics = self._sum_metrics_over_ranks(result.metrics)
        self.last_step_metrics = self._metrics(result, mean_loss, micro_batches, seconds, before)
        if self.global_rank == 0 and self.global_steps % self.steps_per_print() == 0:
            self._log(self.last_step_metrics)
        return torch.tensor(mean_loss)

    def eval_batch(self, data_iter: Iterator, num_micro_batches: Optional[int] = None) -> torch.Tensor:
        """Mean loss over gradient_accumulation_steps (or ``num_micro_batches``) micro-batches, forward
        only (weights fully updated)."""
        losses, metrics = self.executor.evaluate(self._next_micro_batches(data_iter, num_micro_batches))
        self.last_micro_batch_metrics = self._sum_metrics_over_ranks(metrics)
        return torch.tensor(self._mean_over_ranks(losses))

    def _next_micro_batches(self, data_iter: Iterator, count: Optional[int] = None):
        """``count`` (default gradient_accumulation_steps) (inputs, labels) pairs from ``data_iter``, on the
        device. inputs: a tensor, or a dict of the first layer's input and side inputs (micro_batch.py)."""
        if count is not None and count < 1:
            raise ValueError(f"num_micro_batches must be at least 1, got {count}")
        device = accelerator_device()
        wanted = count or self.gradient_accumulation_steps()
        micro_batches = []
        for _ in range(wanted):
            try:
                inputs, labels = next(data_iter)
            except StopIteration:
                raise short_data_error(len(micro_batches), wanted, count is None) from None
            check_inputs(inputs, self._readable_side_inputs)
            micro_batches.append((to_device(inputs, device), to_device(labels, device)))
        return micro_batches

    def _sum_metrics_over_ranks(self, metrics: List[Dict[str, float]]) -> List[Dict[str, float]]:
        """Each micro-batch's metrics summed over the ranks' micro-batches of the same index, in one all-reduce."""
        names = [sorted(each) for each in metrics]
        flat = self.parallel.sum_each([each[name] for each, keys in zip(metrics, names) for name in keys])
        summed, position = [], 0
        for keys in names:
            summed.append(dict(zip(keys, flat[position:position + len(keys)])))
            position += len(keys)
        return summed

    def _mean_over_ranks(self, losses) -> float:
        """The mean over every rank's micro-batches: what one rank with the whole batch would report."""
        return self.parallel.sum(sum(losses) / len(losses)) / self.parallel.world_size

    def flush(self) -> None:
        """Finish every pending optimizer update (the overlap defers some into the next forward)."""
        self.optimizer.flush()

    def start_io_trace(self) -> None:
        """Record every SSD transfer and wait of this rank, its optimizer worker's included, every message
        between the two and every op of the schedule, until ``stop_io_trace`` (io_trace.py)."""
        if self._io_recorder.enabled:
            raise RuntimeError("an I/O trace is already on: call engine.stop_io_trace() first")
        self._io_recorder.start()
        self.optimizer.updater.start_io_trace()

    def stop_io_trace(self) -> IoTrace:
        """What was recorded since ``start_io_trace``: replay it with ``io_replay.replay`` once the run is
        closed, write it with ``io_trace.write_chrome_trace``, or see ``io_trace.time_breakdown``."""
        if not self._io_recorder.enabled:
            raise RuntimeError("no I/O trace is on: call engine.start_io_trace() first")
        worker_events = self.optimizer.updater.stop_io_trace()
        self.executor.resolve_device_times()  # off the CPU: the compute spans' device seconds (one wait)
        return IoTrace(self._io_recorder.stop() + worker_events)

    def close(self) -> None:
        """Finish pending updates, stop the optimizer worker and release the swap folder: its files, aio
        handles and shared memory. The engine trains no more afterwards."""
        try:
            self.optimizer.flush()
        finally:
            self._opened.close()

    def master_parameters(self) -> Dict[str, torch.Tensor]:
        """Every parameter's fp32 master weights by name, read back from SSD (pending updates first); a
        frozen parameter, which has no master, as stored (in the compute dtype), cast to fp32."""
        self.flush()
        names = {param: name for name, param in self.module.named_parameters()}
        result = {}
        for layer in self.layers:
            flat = self._read_full_master(layer.index)
            offset = 0
            for param, shape in zip(layer.params + layer.frozen_params, layer.param_shapes + layer.frozen_shapes):
                result[names[param]] = flat[offset:offset + shape.numel()].view(shape).clone()
                offset += shape.numel()
        return result

    # ------------------------------------------------------------------ the weights, out

    def _install_weight_access(self) -> None:
        """engine.module.state_dict() and GatheredParameters over engine.module read the weights on SSD (weights.py)."""
        source = LayerSource([LayerParams(layer.params + layer.frozen_params, layer.param_shapes + layer.frozen_shapes)
                              for layer in self.layers],
                             self._read_full_master, collective=self.parallel.world_size > 1,
                             read_trainable=self._read_trainable_master)
        self.weight_plan = WeightPlan(self.module, source)
        self._weight_access = ModuleWeightAccess(
            self.module, self.weight_plan, self.compute_dtype, accelerator_device(), self.parallel.world_size,
            lambda index: self.layers[index].state == Residency.RESIDENT, self.data_parallel_group)

    def _read_full_master(self, index: int) -> torch.Tensor:
        """Layer ``index``'s full fp32 master weights, then its frozen weights (cast to fp32: exact)."""
        trainable = self._read_trainable_master(index)
        if not self.layers[index].frozen_numel:
            return trainable
        return torch.cat([trainable, self.layers[index].read_frozen().float()])

    def _read_trainable_master(self, index: int) -> torch.Tensor:
        layer = self.layers[index]
        if not layer.trainable:
            return torch.empty(0, dtype=torch.float32)
        shard = self.optimizer.read_master(layer)  # pending updates first
        return self.parallel.gather_to_host(shard, layer.layout)[:layer.numel]

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradient norm of the last step (before clipping); None before the first."""
        return None if self.last_step_metrics is None else self.last_step_metrics.global_grad_norm

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """DeepSpeed's consolidated state dict: every state_dict() key in the compute dtype (bf16 under bf16,
        fp32 under fp32), tied keys sharing one tensor, on rank 0 (None elsewhere); read one layer at a time.
        Every rank calls it. ``exclude_frozen_parameters``: without the frozen parameters (which are not read)."""
        self.flush()
        return self.weight_plan.state_dict(self.compute_dtype, keep=lambda: self.global_rank == 0,
                                           exclude_frozen=exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's save_16bit_model: rank 0 torch.saves the consolidated state dict (it holds the whole
        model in the compute dtype; engine.save_pretrained holds one layer). Every rank calls it."""
        state_dict = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state_dict, os.path.join(save_dir, save_filename))
        self.parallel.barrier()
        return True

    def save_pretrained(self, save_directory: str, max_shard_size="1GB", dtype=None):
        """The model as a Hugging Face checkpoint: sharded safetensors, their index, config.json (and the
        generation config), loadable with AutoModelForCausalLM.from_pretrained. One layer and one shard
        are in host memory at a time. ``dtype``: the compute dtype by default; ``torch.float32`` gives the
        fp32 master weights under bf16. Every rank calls it; rank 0 writes. Returns the weight files.
        A PEFT model (``peft.get_peft_model``) gives what PEFT writes: its adapters only (the frozen base
        is not read), loadable with ``PeftModel.from_pretrained(base, dir)``."""
        self.flush()
        dtype = as_dtype(dtype, self.compute_dtype)
        if peft_base_model(self.module) is not None:
            files = write_peft_adapters(self.weight_plan, save_directory, dtype, writer=self.global_rank == 0)
        else:
            files = write_hf_checkpoint(self.weight_plan, save_directory, dtype, max_shard_size,
                                        writer=self.global_rank == 0)
        self.parallel.barrier()
        return files

    def save_checkpoint(self, save_dir: str, tag=None, client_state: Optional[dict] = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's save_checkpoint: every SSD-resident tensor (safetensors, one shard per rank), the
        counters, the lr scheduler and ``client_state`` (rank 0's), published atomically (pending updates
        are finished first). Frozen parameters are never in it (``exclude_frozen_parameters`` is always in
        effect): they come back from the model or pretrained folder the engine is initialized with. With ``greedysnake.save_total_limit``, older checkpoints in ``save_dir`` are
        removed afterwards, never the one ``latest`` names."""
        self.flush()
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        counters = {"global_steps": self.global_steps, "global_samples": self.global_samples,
                    "skipped_steps": self.skipped_steps, "compute_dtype": str(self.compute_dtype)}
        state = {"optimizer": self.optimizer.counters_state(),
                 "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                 "client_state": client_state or {}}
        write_checkpoint(save_dir, tag, self.layers, self.optimizer, self.parallel, counters, state, save_latest,
                         self._setup.config.save_total_limit,
                         describe_weights(self.weight_plan) if self.global_rank == 0 else None)
        return True

    def load_checkpoint(self, load_dir: str, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None, trust_pickle: bool = False):
        """DeepSpeed's load_checkpoint; returns ``(path, client_state)``. Any number of ranks loads a
        checkpoint saved by any other number. No pickled code runs: a state file needing anything beyond
        tensors and plain data is refused naming the file and the type, unless ``trust_pickle=True``
        (unsafe: the file can run any code; only for checkpoints whose origin you trust). A checkpoint
        that cannot be loaded (a shard missing or truncated) raises naming it and loads nothing."""
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn is not supported by the greedysnake engine")
        self.flush()
        with_optimizer = load_optimizer_states and not load_module_only
        folder, state = restore_checkpoint(load_dir, tag, self.layers, self.optimizer, self.parallel, with_optimizer,
                                           trust_pickle)
        if not load_module_only:
            self.global_steps, self.global_samples = state["global_steps"], state["global_samples"]
            self.skipped_steps = state["skipped_steps"]
            if with_optimizer:
                self.optimizer.load_counters_state(state["optimizer"])
            if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        return folder, state["client_state"]

    def forward(self, *args, **kwargs):
        raise RuntimeError("the greedysnake engine runs whole steps: call engine.train_batch(data_iter), "
                           "or engine.eval_batch(data_iter) for a forward-only loss")

    def backward(self, *args, **kwargs):
        raise RuntimeError("the greedysnake engine runs whole steps: call engine.train_batch(data_iter)")

    def step(self, *args, **kwargs):
        raise RuntimeError("the greedysnake engine runs whole steps: call engine.train_batch(data_iter)")

    def _metrics(self, result: StepResult, mean_loss: float, micro_batches, seconds: float, before) -> StepMetrics:
        after = self.io_counters.snapshot()
        delta = lambda kind: {k: v - before[kind].get(k, 0) for k, v in after[kind].items()}
        tokens = sum(token_count(inputs) for inputs, _ in micro_batches)
        return StepMetrics(self.global_steps, mean_loss, tokens, seconds, delta("bytes_read"), delta("bytes_written"),
                           delta("reads"), result.seconds_by_op, result.decision.global_grad_norm,
                           result.decision.skipped, result.optimizer_seconds, result.optimizer_wait_seconds)

    def _log(self, metrics: StepMetrics) -> None:
        read_mb = sum(metrics.ssd_bytes_read.values()) / 2**20
        written_mb = sum(metrics.ssd_bytes_written.values()) / 2**20
        logger.info(f"greedysnake step {metrics.step}: loss {metrics.loss:.4f} tokens/s {metrics.tokens_per_second:.0f} "
                    f"SSD read {read_mb:.1f} MiB written {written_mb:.1f} MiB grad-norm {metrics.global_grad_norm:.3f} "
                    f"optimizer {metrics.optimizer_seconds:.2f}s ({100 * metrics.optimizer_hidden_share:.0f}% hidden) "
                    f"compute {metrics.compute_seconds:.2f}s")

