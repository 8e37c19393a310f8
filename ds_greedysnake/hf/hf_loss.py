"""Trainer's loss of one micro-batch, as the greedysnake engine's ``loss_fn`` (GreedySnakeTrainer, hf_trainer.py)."""
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


@dataclass
class LossScaling:
    """How TrainerLoss turns the model's loss of a micro-batch into the engine's."""
    num_items_in_batch: Any  # for the model's loss_function (a token sum over it); None: a per-micro-batch mean
    multiplier: int = 1


class TrainerLoss:
    """The engine's ``loss_fn``: Trainer's loss ``v`` of one micro-batch, times a multiplier.

    The engine backpropagates ``loss / M`` for each of a window's M micro-batches and averages gradients
    and the reported loss over ranks; Trainer backpropagates ``v`` per micro-batch (DeepSpeed averages the
    gradients over ranks) and logs the sum of ``v`` over the window. So a training window's multiplier
    holds the M that the engine divides by again (``GreedySnakeTrainerMixin._loss_scaling``).
    ``configure`` sets the scaling before each window or eval batch; ``last_value`` is the latest result.
    """

    def __init__(self, loss_function: Callable, vocab_size: int):
        self.loss_function = loss_function
        self.vocab_size = vocab_size
        self.scaling = LossScaling(None)
        self.last_value: Optional[torch.Tensor] = None

    def configure(self, scaling: LossScaling) -> None:
        self.scaling = scaling

    def __call__(self, output, labels: torch.Tensor) -> torch.Tensor:
        logits = getattr(output, "logits", output)
        items = self.scaling.num_items_in_batch
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size,
                                  **({} if items is None else {"num_items_in_batch": items}))
        if self.scaling.multiplier != 1:
            loss = loss * self.scaling.multiplier
        self.last_value = loss.detach()
        return loss
