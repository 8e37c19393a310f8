"""Device memory of one configuration (micro-batch size, M) of each engine, and which ones fit.

Bytes on the device, by what holds them (``DeviceBytes``); a configuration fits when their total is
within ``device_memory_bytes`` (the workspace is one of them). Per token, with h the hidden size, a the
heads, s the sequence length, b the compute dtype's bytes:

* one layer's working set for one micro-batch (its backward with the recompute): a block keeps 16 h
  elements per token for backward (LayerNorm inputs, QKV, attention output, the MLP's 4h input and
  4h GELU output; Korthikanti et al. 2022's 34 s b h bytes less the dropout masks and dropout outputs
  this GPT does not have) plus its input and output gradient (2 h), and a s elements of attention scores
  when the kernel keeps them (``device_attention_keeps_scores``: a plain softmax attention; a fused one
  does not). The head: the logits in the compute dtype, their fp32 copy's log-softmax kept for
  backward, its gradient and the logits' gradient in fp32 and in the compute dtype:
  vocab x (2 b + 12) bytes per token (``ds_greedysnake.models.gpt.lm_loss`` upcasts to fp32).
  These are estimates of what autograd keeps, not measurements.

greedysnake, as the engine holds it (engine.py, layer.py, executor.py, activations.py):
* parameters: the buffer pool, 1 + prefetch_depth buffers of the largest layer (one more with tied
  embeddings), in the compute dtype;
* gradients: the layer's accumulator (fp32 with ``fp32_grad_accumulation``, the default) and, under bf16,
  autograd's ``param.grad`` before it is added in;
* activations: the largest layer's working set for one micro-batch;
* checkpoints: the activation gradients between two layers of all M micro-batches (``output_grads``),
  the snake's resident layer output and the layer input being recomputed. Every other checkpoint is in
  host memory or on SSD (the host budget's business, search.py).

ZeRO-Infinity, by DeepSpeed 0.19.8's rules (``HorizontalSettings``):
* parameters: every tensor of at most ``stage3_param_persistence_threshold`` elements stays on the
  device for the whole run (all layers); the gathered ones are the largest layer's other tensors plus
  the prefetch bucket (``stage3_prefetch_bucket_size`` elements, when prefetch is on), at most
  ``stage3_max_live_parameters``; with the fetch reuse on, a checkpointed block stays gathered from its
  recompute to its backward, so a whole layer is counted; without it, the largest tensor;
* gradients: the largest layer's, in the compute dtype, plus the reduce bucket (``reduce_bucket_size``
  elements, at most the model's);
* activations: the largest layer's working set for one micro-batch (its recompute with activation
  checkpointing); without it, every block's working set stays until backward (counted as checkpoints);
* checkpoints: with activation checkpointing, every block's input for the micro-batch (DeepSpeed keeps
  them on the device unless ``cpu_checkpointing``), the embedding's output and one activation gradient.
"""
from dataclasses import asdict, dataclass
from typing import Dict

from .cost_model import GRAD_BYTES_PER_PARAM, Workload
from .zero_model import HorizontalSettings
from .hardware import Hardware
from .shapes import GPTShape, LayerShape

FP32 = 4


@dataclass(frozen=True)
class DeviceBytes:
    """Bytes on the device at its fullest, by what holds them."""
    parameters: float
    gradients: float
    activations: float   # the largest layer's working set for one micro-batch
    checkpoints: float   # what stays across layers (see the module docstring, per engine)
    workspace: float     # hardware.device_workspace_bytes

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.activations + self.checkpoints + self.workspace

    def to_dict(self) -> Dict[str, float]:
        return dict(asdict(self), total=self.total)


def layer_working_set_bytes(layer: LayerShape, shape: GPTShape, tokens: int, dtype_bytes: int,
                            keeps_scores: bool) -> float:
    """One layer's backward (with its recompute) for ``tokens`` tokens of one micro-batch."""
    if layer.kind == "block":
        per_token = (16 + 2) * shape.hidden * dtype_bytes
        if keeps_scores:
            per_token += shape.heads * shape.seq_len * dtype_bytes
        return tokens * per_token
    if layer.kind == "head":
        return tokens * shape.vocab * (2 * dtype_bytes + 3 * FP32)
    return tokens * 2 * shape.hidden * dtype_bytes  # the embedding: its output and that output's gradient


def largest_working_set_bytes(workload: Workload, hardware: Hardware) -> float:
    shape = workload.shape
    return max(layer_working_set_bytes(layer, shape, workload.tokens_per_micro_batch, workload.activation_bytes,
                                       hardware.device_attention_keeps_scores) for layer in shape.layers)


def greedysnake_device_bytes(workload: Workload, hardware: Hardware, prefetch_depth: int = 1,
                             tied: bool = False) -> DeviceBytes:
    layers = workload.shape.layers
    largest = max(layer.params for layer in layers)
    buffers = 1 + prefetch_depth + (1 if tied else 0)
    # bf16: autograd's param.grad in the compute dtype, then added into the fp32 accumulator; fp32: views of it.
    gradients = largest * (GRAD_BYTES_PER_PARAM + (workload.param_bytes if workload.param_bytes != FP32 else 0))
    boundary = workload.checkpoint_bytes  # one layer boundary's activation of one micro-batch
    return DeviceBytes(parameters=buffers * workload.param_bytes * largest, gradients=gradients,
                       activations=largest_working_set_bytes(workload, hardware),
                       checkpoints=(workload.micro_batches + 2) * boundary,
                       workspace=hardware.device_workspace_bytes or 0.0)


def persistent_elements(shape: GPTShape, threshold: float) -> int:
    """Elements of the tensors ZeRO-3 keeps on the device for the whole run (at most ``threshold`` each)."""
    return sum(numel for layer in shape.layers for numel in layer.tensor_numels if numel <= threshold)


def zero_infinity_device_bytes(workload: Workload, hardware: Hardware, settings: HorizontalSettings) -> DeviceBytes:
    shape, b = workload.shape, workload.param_bytes
    threshold = settings.persistence_threshold
    if settings.reuse_recompute_fetch:  # a layer stays gathered from its recompute to its backward
        gathered = max(sum(n for n in layer.tensor_numels if n > threshold) for layer in shape.layers)
    else:                               # each tensor is released after its module ran
        gathered = max(n for layer in shape.layers for n in layer.tensor_numels)
    if settings.prefetch:
        gathered += settings.prefetch_bucket_elements
    gathered = min(gathered, max(settings.max_live_parameters, max(max(l.tensor_numels) for l in shape.layers)))
    largest = max(layer.params for layer in shape.layers)
    gradients = b * (largest + min(settings.reduce_bucket_elements, shape.params))
    working_sets = [layer_working_set_bytes(layer, shape, workload.tokens_per_micro_batch, workload.activation_bytes,
                                            hardware.device_attention_keeps_scores) for layer in shape.layers]
    boundary = workload.checkpoint_bytes
    if settings.recompute:
        kept = (shape.num_blocks + 2) * boundary  # every block's input, the embedding's output, one gradient
    else:
        kept = sum(ws for ws, layer in zip(working_sets, shape.layers) if layer.kind == "block") + 2 * boundary
    return DeviceBytes(parameters=b * (persistent_elements(shape, threshold) + gathered), gradients=gradients,
                       activations=max(working_sets), checkpoints=kept,
                       workspace=hardware.device_workspace_bytes or 0.0)


def fits(device: DeviceBytes, hardware: Hardware) -> bool:
    """Whether a configuration fits the device; every one fits a device of unknown memory (the CPU
    accelerator: its memory is the host's, which the host budget already counts)."""
    return hardware.device_memory_bytes is None or device.total <= hardware.device_memory_bytes
