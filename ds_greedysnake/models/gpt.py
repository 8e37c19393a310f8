"""A small GPT (pre-norm blocks, causal attention) built as [embedding, blocks..., head].

It knows nothing of offload or scheduling: the engine splits it into layers from outside.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 64
    hidden: int = 256
    num_heads: int = 4
    num_layers: int = 4
    mlp_ratio: int = 4


class Embedding(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.hidden)
        self.positions = nn.Embedding(config.seq_len, config.hidden)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(token_ids.shape[1], device=token_ids.device)
        return self.tokens(token_ids) + self.positions(positions)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.norm1 = nn.LayerNorm(config.hidden)
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.norm2 = nn.LayerNorm(config.hidden)
        self.up = nn.Linear(config.hidden, config.mlp_ratio * config.hidden)
        self.down = nn.Linear(config.mlp_ratio * config.hidden, config.hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq, width = hidden.shape
        q, k, v = self.qkv(self.norm1(hidden)).split(width, dim=-1)
        heads = lambda t: t.view(batch, seq, self.num_heads, width // self.num_heads).transpose(1, 2)
        attended = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        hidden = hidden + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return hidden + self.down(F.gelu(self.up(self.norm2(hidden))))


class Head(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def build_gpt(config: GPTConfig) -> nn.Sequential:
    return nn.Sequential(Embedding(config), *[Block(config) for _ in range(config.num_layers)], Head(config))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; labels are the inputs shifted by one."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def synthetic_corpus(num_tokens: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """A learnable token stream made here (no downloads): noisy repetitions of a few short phrases."""
    generator = torch.Generator().manual_seed(seed)
    phrases = torch.randint(0, vocab_size, (16, 12), generator=generator)
    picks = torch.randint(0, phrases.shape[0], (num_tokens // phrases.shape[1] + 1,), generator=generator)
    stream = phrases[picks].reshape(-1)[:num_tokens].clone()
    noise = torch.rand(num_tokens, generator=generator) < 0.05
    stream[noise] = torch.randint(0, vocab_size, (int(noise.sum()),), generator=generator)
    return stream


def micro_batches(corpus: torch.Tensor, micro_batch_size: int, seq_len: int, seed: int = 0):
    """Endless (inputs, labels) micro-batches of random windows of the corpus."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, corpus.numel() - seq_len - 1, (micro_batch_size,), generator=generator)
        windows = torch.stack([corpus[s:s + seq_len + 1] for s in starts.tolist()])
        yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
