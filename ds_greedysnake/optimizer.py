"""Adam over SSD-resident optimizer states, one layer at a time, split into global and per-layer parts.

Per layer, one SSD region holds [fp32 master | exp_avg | exp_avg_sq] and another the fp32
gradient accumulated over the step. The global part of a step (gradient norm, non-finite check,
clip coefficient, learning rate, step count) needs every layer's gradient and is decided once;
the per-layer update then reads that layer's states and gradient, runs DeepSpeed's CPU Adam
kernel, writes the states back and hands the new low-precision weights to the layer.
"""
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .deepspeed_compat import AdamHyperparameters, CpuAdamKernel
from .layer import LayerOwner
from .ssd import Region, SsdStore, aligned_buffer, padded_size

_KNOWN_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "torch_adam"}


@dataclass
class StepDecision:
    """The global part of one optimizer step."""
    step: int                 # Adam's step count used by this update (1-based)
    clip_coefficient: float   # multiply gradients by this (1.0: no clipping)
    global_grad_norm: float
    skipped: bool             # a non-finite gradient somewhere: no layer is updated
    hyper: AdamHyperparameters


def adam_settings(ds_optimizer: Dict[str, Any]):
    """Hyperparameters and AdamW mode from ds_config's "optimizer" block, as DeepSpeed reads it."""
    params = dict(ds_optimizer.get("params", {}))
    unknown = set(params) - _KNOWN_ADAM_PARAMS
    if unknown:
        raise ValueError(f"optimizer.params has keys greedysnake does not know: {sorted(unknown)}; "
                         f"known: {sorted(_KNOWN_ADAM_PARAMS)}")
    betas = params.get("betas", (0.9, 0.999))
    hyper = AdamHyperparameters(lr=float(params.get("lr", 1e-3)), beta1=float(betas[0]), beta2=float(betas[1]),
                                eps=float(params.get("eps", 1e-8)), weight_decay=float(params.get("weight_decay", 0.0)),
                                bias_correction=bool(params.get("bias_correction", True)))
    # DeepSpeed's "Adam" is decoupled-weight-decay AdamW unless adam_w_mode is false.
    adamw_mode = str(ds_optimizer.get("type")).lower() == "adamw" or bool(params.get("adam_w_mode", True))
    return hyper, adamw_mode


class LayerwiseAdam:
    """Looks like a torch optimizer to DeepSpeed's lr schedulers (``param_groups[0]["lr"]``)."""

    def __init__(self, layers: List[LayerOwner], store: SsdStore, ds_optimizer: Dict[str, Any],
                 gradient_clipping: float):
        hyper, adamw_mode = adam_settings(ds_optimizer)
        self.param_groups = [{"params": [], "lr": hyper.lr, "betas": (hyper.beta1, hyper.beta2), "eps": hyper.eps,
                              "weight_decay": hyper.weight_decay, "bias_correction": hyper.bias_correction}]
        self.state: Dict[Any, Any] = {}
        self.gradient_clipping = gradient_clipping
        self.step_count = 0
        self.skipped_steps = 0
        self._kernel = CpuAdamKernel(hyper, adamw_mode)
        self._layers = layers
        self._store = store
        self._state_regions: List[Region] = []
        self._grad_regions: List[Region] = []
        self._grad_sq_norms: List[Optional[float]] = [None] * len(layers)
        largest = max(layer.numel for layer in layers)
        self._state_buffer = aligned_buffer(padded_size(12 * largest))
        self._grad_buffer = aligned_buffer(padded_size(4 * largest))
        for layer in layers:
            self._state_regions.append(store.create_region(f"opt_l{layer.index}", 12 * layer.numel, "optimizer"))
            self._grad_regions.append(store.create_region(f"grad_l{layer.index}", 4 * layer.numel, "grad"))

    def initialise_layer(self, layer: LayerOwner, master: torch.Tensor) -> None:
        """Write the fp32 master weights and zero moments of a layer before its first step."""
        states = self._state_views(layer)
        states[0].copy_(master)
        states[1].zero_()
        states[2].zero_()
        self._store.write(self._state_regions[layer.index], self._state_buffer)

    def receive_gradient(self, layer: LayerOwner, grads: torch.Tensor) -> None:
        """Take a layer's gradient for this step (once per step) and move it to SSD."""
        host_grads = self._grad_buffer[:4 * layer.numel].view(torch.float32)
        host_grads.copy_(grads)
        self._grad_sq_norms[layer.index] = float(host_grads.double().pow(2).sum())
        self._store.write(self._grad_regions[layer.index], self._grad_buffer)

    def decide_step(self) -> StepDecision:
        """The global part: needs every layer's gradient of this step."""
        missing = [index for index, value in enumerate(self._grad_sq_norms) if value is None]
        assert not missing, f"layers {missing} handed no gradient this step"
        norm = math.sqrt(sum(self._grad_sq_norms))
        self._grad_sq_norms = [None] * len(self._layers)
        group = self.param_groups[0]
        hyper = AdamHyperparameters(lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1],
                                    eps=group["eps"], weight_decay=group["weight_decay"],
                                    bias_correction=group["bias_correction"])
        skipped = not math.isfinite(norm)
        coefficient = 1.0
        if self.gradient_clipping > 0 and not skipped:
            # DeepSpeed's rule: divide by (norm + 1e-6) / clip when that exceeds 1.
            ratio = (norm + 1e-6) / self.gradient_clipping
            coefficient = 1.0 / ratio if ratio > 1 else 1.0
        if skipped:
            self.skipped_steps += 1
        else:
            self.step_count += 1
        return StepDecision(self.step_count, coefficient, norm, skipped, hyper)

    def update_layer(self, layer: LayerOwner, decision: StepDecision) -> None:
        """The per-layer part: read states and gradient, Adam, write states and new weights."""
        if decision.skipped:
            return
        self._store.read(self._state_regions[layer.index], self._state_buffer)
        self._store.read(self._grad_regions[layer.index], self._grad_buffer)
        master, exp_avg, exp_avg_sq = self._state_views(layer)
        grads = self._grad_buffer[:4 * layer.numel].view(torch.float32)
        if decision.clip_coefficient != 1.0:
            grads.mul_(decision.clip_coefficient)
        self._kernel.update(decision.step, decision.hyper, master, grads, exp_avg, exp_avg_sq)
        self._store.write(self._state_regions[layer.index], self._state_buffer)
        layer.write_parameters(master)

    def read_master(self, layer: LayerOwner) -> torch.Tensor:
        """A copy of a layer's fp32 master weights (for checks and gathering the full model)."""
        self._store.read(self._state_regions[layer.index], self._state_buffer)
        return self._state_views(layer)[0].clone()

    def _state_views(self, layer: LayerOwner):
        flat = self._state_buffer[:12 * layer.numel].view(torch.float32)
        return flat[:layer.numel], flat[layer.numel:2 * layer.numel], flat[2 * layer.numel:]

    # torch-optimizer surface DeepSpeed's engine and schedulers touch
    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

