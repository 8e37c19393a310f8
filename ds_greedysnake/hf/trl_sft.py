"""TRL's SFTTrainer on the greedysnake engine: its loss and logged metrics, computed in the head layer.

What SFTTrainer.compute_loss does (trl 1.16) and where it happens here:

* The loss: SFTTrainer patches the model with TRL's fused LM head (``add_fused_lm_head``), which projects
  the final hidden states through the LM head in tiles (``trl.kernels.ChunkedLogProbFunction``, never the
  whole logits) into per-token log-probabilities, entropies and top-1 hits, zero where the label is -100;
  the loss is ``-sum(log_probs) / (num_items_in_batch or the micro-batch's label count)`` ("dft": each
  token's term times its probability), times the number of ranks under
  ``average_tokens_across_devices``. Here the head layer returns its final hidden states with the LM
  head (``HfHead.returns_hidden_states``) and ``SftLoss`` runs TRL's own kernel on them, per micro-batch,
  inside the engine's step; Trainer's accumulation scaling is ``TrainerLoss``'s.
* The metrics: per micro-batch, SFTTrainer gathers over the ranks the label count, the entropy sum and
  the top-1 count, and appends ``entropy`` and ``mean_token_accuracy`` (sum / count) to its metric lists,
  which ``log()`` averages; ``num_tokens`` adds up the attention mask (or the packed row's length) over
  the ranks. ``SftLoss`` returns the three sums next to the loss (micro_batch.LossWithMetrics), the engine
  sums them over ranks, and ``record_metrics`` appends what SFTTrainer would have.

This module imports trl only when a trainer is an SFTTrainer (so only where trl is installed).
"""
import sys
from typing import Any, Dict, List, Optional

import torch

from .hf_loss import TrainerLoss
from ..models.micro_batch import LossWithMetrics
from ..models.hf import HeadHiddenStates, HfHead

# The fused head's outputs SFTTrainer asks for (its add_fused_lm_head call), in the kernel's order.
_FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")
_SFT_LOSS_TYPES = ("nll", "chunked_nll", "dft")


def sft_trainer_base(trainer) -> Optional[type]:
    """trl's SFTTrainer if ``trainer`` is one, else None. A trainer can be one only once trl's module is
    imported, so nothing here imports trl for a plain Trainer."""
    module = sys.modules.get("trl.trainer.sft_trainer")
    base = getattr(module, "SFTTrainer", None)
    return base if base is not None and isinstance(trainer, base) else None


def refuse_sft_options(trainer, error: type) -> None:
    """What SFTTrainer offers that the engine cannot run, refused with the option named."""
    args = trainer.args
    refused = {
        "use_liger_kernel": bool(getattr(args, "use_liger_kernel", False)),
        "activation_offloading": bool(getattr(args, "activation_offloading", False)),
        # The MoE load-balancing loss needs every layer's router logits outside the engine's layers.
        "router_aux_loss_coef / output_router_logits (MoE aux loss)": bool(getattr(trainer, "aux_loss_enabled", False)),
    }
    for option, set_ in refused.items():
        if set_:
            raise error(f"{option} is set, which greedysnake cannot run with SFTTrainer (the engine computes "
                        f"SFTTrainer's loss in its head layer from the final hidden states): unset it, or train "
                        f"with the \"greedysnake\" block off")
    if args.loss_type not in _SFT_LOSS_TYPES:
        raise error(f"SFTConfig.loss_type={args.loss_type!r} is not one greedysnake computes: use one of "
                    f"{list(_SFT_LOSS_TYPES)}")


def head_for_sft(engine, error: type) -> HfHead:
    """The engine's head layer, switched to hand its final hidden states to SftLoss."""
    head = engine.layers[-1].module
    if not isinstance(head, HfHead):
        raise error(f"SFTTrainer on greedysnake needs the automatic Hugging Face split, whose head layer computes "
                    f"TRL's fused LM head loss; this model's head layer is {type(head).__name__} "
                    "(greedysnake_layers()): train it with transformers' Trainer (GreedySnakeTrainer)")
    head.returns_hidden_states = True
    return head


class SftLoss(TrainerLoss):
    """The engine's ``loss_fn`` for SFTTrainer: its loss of one micro-batch (TRL's fused LM head on the
    head layer's final hidden states), scaled as TrainerLoss scales Trainer's, with the metric sums."""

    def __init__(self, loss_type: str, vocab_size: int):
        super().__init__(loss_function=None, vocab_size=vocab_size)
        self.loss_type = loss_type

    def __call__(self, output, labels: torch.Tensor) -> LossWithMetrics:
        if not isinstance(output, HeadHiddenStates):
            raise TypeError(f"SftLoss takes the head's HeadHiddenStates, got {type(output).__name__}")
        log_probs, entropy, is_top1, mask = fused_head_outputs(output, labels)
        per_token_loss = -log_probs
        if self.loss_type == "dft":
            per_token_loss = per_token_loss * log_probs.exp().detach()
        items = self.scaling.num_items_in_batch
        tokens = mask.sum() if items is None else items
        loss = per_token_loss.sum() / torch.as_tensor(tokens).clamp(min=1)
        if self.scaling.multiplier != 1:
            loss = loss * self.scaling.multiplier
        self.last_value = loss.detach()
        return LossWithMetrics(loss, {"num_valid": mask.sum(), "entropy_sum": entropy.detach().sum(),
                                      "num_correct": is_top1.sum()})


def fused_head_outputs(output: HeadHiddenStates, labels: torch.Tensor):
    """Per next-token label: log-probability, entropy, top-1 hit (zero where the label is -100) and the
    label mask, by TRL's kernel as its fused LM head calls it (temperature 1, no logit transform: the
    split refuses models whose forward transforms the logits)."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.kernels.chunked_logprob import _use_triton  # scores valid positions only where Triton runs
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    hidden, targets = output.hidden_states[:, :-1], labels[:, 1:]
    lm_head = output.lm_head
    mask = targets != -100
    compact = _use_triton(hidden.device)
    scored = ChunkedLogProbFunction.apply(
        hidden[mask] if compact else hidden.reshape(-1, hidden.size(-1)), lm_head.weight, lm_head.bias,
        targets[mask] if compact else targets.clamp(min=0).reshape(-1), 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
        _FUSED_OUTPUTS)
    log_probs, entropy, _, _, is_top1 = scored
    if compact:
        placed = [value.new_zeros(mask.shape).masked_scatter(mask, value) for value in (log_probs, entropy, is_top1)]
    else:
        placed = [value.view(mask.shape).masked_fill(~mask, 0) for value in (log_probs, entropy, is_top1)]
    return (*placed, mask)


def _ratio(total: float, count: float) -> float:
    # As SFTTrainer: a float32 sum over an integer count, 0.0 without any counted token.
    return (torch.tensor(total, dtype=torch.float32) / torch.tensor(int(count))).item() if count > 0 else 0.0


def record_metrics(trainer, mode: str, metrics: List[Dict[str, float]], samples: List[Dict[str, Any]]) -> None:
    """Append what SFTTrainer.compute_loss appends for these micro-batches (``metrics``: the engine's
    per-micro-batch sums over ranks; ``samples``: this rank's batches, for the token count)."""
    for each in metrics:
        trainer._metrics[mode]["entropy"].append(_ratio(each["entropy_sum"], each["num_valid"]))
        trainer._metrics[mode]["mean_token_accuracy"].append(_ratio(each["num_correct"], each["num_valid"]))
    if mode == "train":
        local = sum(_tokens_in(sample) for sample in samples)
        device = samples[0]["input_ids"].device
        tokens = int(trainer.accelerator.gather_for_metrics(torch.tensor(local, device=device)).sum().item())
        trainer._total_train_tokens += tokens // trainer._tp_size
    trainer._metrics[mode]["num_tokens"] = [trainer._total_train_tokens]


def _tokens_in(sample: Dict[str, Any]) -> int:
    if "attention_mask" in sample:
        return int(sample["attention_mask"].sum())
    if "position_ids" in sample:
        return int(sample["position_ids"].size(1))
    raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")  # SFTTrainer's own error
