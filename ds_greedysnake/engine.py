"""The vertical engine: DeepSpeed's engine whose training step is the GreedySnake schedule."""
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

import torch
from deepspeed.utils import logger

from .activations import ActivationStore
from .config import GreedySnakeConfig
from .deepspeed_compat import EngineBase, accelerator_device
from .executor import Executor, StepResult
from .layer import BufferPool, LayerOwner
from .model_split import split_model
from .optimizer import LayerwiseAdam
from .ssd import IoCounters, SsdStore, padded_size


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

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


class _Setup:
    """Arguments the subclass needs inside DeepSpeed's constructor (kept off nn.Module attributes)."""

    def __init__(self, config: GreedySnakeConfig, loss_fn: Callable, nvme_path: str):
        self.config, self.loss_fn, self.nvme_path = config, loss_fn, nvme_path


class GreedySnakeEngine(EngineBase):

    def __init__(self, greedysnake_config: GreedySnakeConfig, loss_fn: Callable, nvme_path: str, **ds_kwargs):
        self._setup = _Setup(greedysnake_config, loss_fn, nvme_path)
        self.io_counters = IoCounters()
        self.last_step_metrics: Optional[StepMetrics] = None
        super().__init__(**ds_kwargs)

    # Called by DeepSpeed's constructor once the model is placed and cast.
    def build_optimizer(self) -> LayerwiseAdam:
        if self.dp_world_size > 1:
            raise NotImplementedError(
                f"greedysnake runs one data-parallel rank for now (got {self.dp_world_size}); "
                'run one process, or set "greedysnake": {"enabled": false} for ZeRO-Infinity')
        setup = self._setup
        self.compute_dtype = torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        accumulate_dtype = torch.float32 if setup.config.fp32_grad_accumulation else self.compute_dtype
        device = accelerator_device()
        folder = os.path.join(setup.nvme_path, setup.config.swap_dir_name, f"rank{self.global_rank}")
        self.swap_folder = folder
        modules = split_model(self.module)
        frozen = [name for name, p in self.module.named_parameters() if not p.requires_grad]
        if frozen:
            raise ValueError(f"frozen parameters {frozen[:5]} are not supported by greedysnake yet: "
                             "make them trainable or move them out of the model")
        self.layers = [LayerOwner(index, module, self.compute_dtype, device) for index, module in enumerate(modules)]
        param_store = SsdStore(folder, self.ds_config_dict, self.io_counters, "param")
        optimizer_store = SsdStore(folder, self.ds_config_dict, self.io_counters, "optimizer")
        activation_store = SsdStore(folder, self.ds_config_dict, self.io_counters, "activation")
        optimizer = LayerwiseAdam(self.layers, optimizer_store, self.ds_config_dict["optimizer"],
                                  float(self.gradient_clipping() or 0.0))
        # Two buffers: the layer computing and the one being prefetched.
        pool = BufferPool(max(padded_size(layer.payload_bytes) for layer in self.layers), count=2)
        for layer in self.layers:
            flat = layer.flat_parameters()
            optimizer.initialise_layer(layer, flat.float())
            layer.offload(param_store, param_store.create_region(f"l{layer.index}", layer.payload_bytes, "param"),
                          pool, flat)
        budget = int(setup.config.activation_host_memory_mb * 2**20)
        self.activations = ActivationStore(activation_store, budget, device)
        self.executor = Executor(self.layers, self.activations, optimizer, setup.loss_fn, accumulate_dtype,
                                 setup.config.prefetch)
        return optimizer

    def train_batch(self, data_iter: Iterator) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches from ``data_iter``."""
        device = accelerator_device()
        num_micro_batches = self.gradient_accumulation_steps()
        micro_batches = []
        for _ in range(num_micro_batches):
            inputs, labels = next(data_iter)
            micro_batches.append((inputs.to(device), labels.to(device)))
        before = self.io_counters.snapshot()
        started = time.perf_counter()
        result = self.executor.run_step(micro_batches)
        seconds = time.perf_counter() - started
        if result.decision.skipped:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        mean_loss = sum(result.losses) / num_micro_batches
        self.last_step_metrics = self._metrics(result, mean_loss, micro_batches, seconds, before)
        if self.global_rank == 0 and self.global_steps % self.steps_per_print() == 0:
            self._log(self.last_step_metrics)
        return torch.tensor(mean_loss)

    def master_parameters(self) -> Dict[str, torch.Tensor]:
        """Every parameter's fp32 master weights by name, read back from SSD."""
        names = {param: name for name, param in self.module.named_parameters()}
        result = {}
        for layer in self.layers:
            flat = self.optimizer.read_master(layer)
            offset = 0
            for param, shape in zip(layer.params, layer.param_shapes):
                result[names[param]] = flat[offset:offset + shape.numel()].view(shape).clone()
                offset += shape.numel()
        return result

    def forward(self, *args, **kwargs):
        raise RuntimeError("the greedysnake engine runs whole steps: call engine.train_batch(data_iter)")

    def backward(self, *args, **kwargs):
        raise RuntimeError("the greedysnake engine runs whole steps: call engine.train_batch(data_iter)")

    def step(self, *args, **kwargs):
        raise RuntimeError("the greedysnake engine runs whole steps: call engine.train_batch(data_iter)")

    def _metrics(self, result: StepResult, mean_loss: float, micro_batches, seconds: float, before) -> StepMetrics:
        after = self.io_counters.snapshot()
        delta = lambda kind: {k: v - before[kind].get(k, 0) for k, v in after[kind].items()}
        tokens = sum(inputs.numel() for inputs, _ in micro_batches)
        return StepMetrics(self.global_steps, mean_loss, tokens, seconds, delta("bytes_read"), delta("bytes_written"),
                           delta("reads"), result.seconds_by_op, result.decision.global_grad_norm,
                           result.decision.skipped)

    def _log(self, metrics: StepMetrics) -> None:
        read_mb = sum(metrics.ssd_bytes_read.values()) / 2**20
        written_mb = sum(metrics.ssd_bytes_written.values()) / 2**20
        logger.info(f"greedysnake step {metrics.step}: loss {metrics.loss:.4f} tokens/s {metrics.tokens_per_second:.0f} "
                    f"SSD read {read_mb:.1f} MiB written {written_mb:.1f} MiB grad-norm {metrics.global_grad_norm:.3f}")

