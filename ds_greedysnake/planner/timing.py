"""Timings both probes share (``probe.py`` and ``zero_probe.py``'s child): a median of repeats, and a model's
layers timed as the engine runs them."""
import statistics
import time
from typing import Callable, Dict, Sequence

import torch

from .cost_model import Workload
from .hardware import LayerTimes


def median_seconds(action: Callable[[], None], repeats: int, warmup: int = 1, min_seconds: float = 0.0) -> float:
    """Median of ``repeats`` timed runs after ``warmup``, more while they add up to under ``min_seconds``
    (a millisecond layer timed five times moved by 30% between probes here)."""
    times = []
    while len(times) < repeats or sum(times) < min_seconds:
        started = time.perf_counter()
        action()
        elapsed = time.perf_counter() - started
        if warmup:
            warmup -= 1
        else:
            times.append(elapsed)
    return statistics.median(times)


def probe_layers(workload: Workload, device: torch.device, repeats: int = 5,
                 kinds: Sequence[str] = ("embedding", "block", "head")) -> Dict[str, LayerTimes]:
    """Seconds per micro-batch of the embedding, one block and the head with the loss (those of
    ``kinds``), run as the engine runs them: forward without a graph; recompute with a graph and
    backward, the gradients accumulating in place in views of one flat accumulator."""
    from ..models.gpt import Block, Embedding, GPTConfig, Head, lm_loss
    shape = workload.shape
    config = GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq_len, hidden=shape.hidden,
                       num_heads=shape.heads, num_layers=1, mlp_ratio=shape.mlp_ratio)
    dtype = {4: torch.float32, 2: torch.bfloat16}[workload.param_bytes]
    tokens = torch.randint(0, shape.vocab, (workload.micro_batch_size, shape.seq_len), device=device)
    hidden = torch.randn(workload.micro_batch_size, shape.seq_len, shape.hidden, device=device, dtype=dtype)
    synchronize = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
    times = {}
    for kind, build, layer_input in (("embedding", Embedding, tokens), ("block", Block, hidden), ("head", Head, hidden)):
        if kind not in kinds:
            continue
        module = build(config).to(device=device, dtype=dtype)
        accumulator = torch.zeros(sum(p.numel() for p in module.parameters()), device=device, dtype=dtype)
        offset = 0
        for param in module.parameters():  # autograd adds each micro-batch's gradient into these views
            param.grad = accumulator[offset:offset + param.numel()].view_as(param)
            offset += param.numel()

        def forward():
            with torch.no_grad():
                module(layer_input)
            synchronize()

        def forward_backward():
            source = layer_input if kind == "embedding" else layer_input.detach().requires_grad_(True)
            output = module(source)
            if kind == "head":
                lm_loss(output, tokens).backward()
            else:
                output.backward(torch.ones_like(output))
            synchronize()

        times[kind] = LayerTimes(median_seconds(forward, repeats, min_seconds=0.1 * repeats / 5),
                                 median_seconds(forward_backward, repeats, min_seconds=0.2 * repeats / 5))
    return times
