"""``GreedySnakeSFTTrainer``: TRL's SFTTrainer on the greedysnake engine, switched by one import.

``from ds_greedysnake import GreedySnakeSFTTrainer as SFTTrainer`` and a ``"greedysnake": {"enabled": true}``
block in the DeepSpeed config: SFTTrainer's loss, its logged metrics (entropy, mean_token_accuracy,
num_tokens), packing (padded or padding-free), completion-only and assistant-only losses and a
``peft_config`` train on the engine (trl_sft.py says how). With the block off it is SFTTrainer under
DeepSpeed, unchanged. Needs trl (``pip install ds_greedysnake[trl]``).
"""
from trl import SFTTrainer

from .hf_trainer import GreedySnakeTrainerMixin


class GreedySnakeSFTTrainer(GreedySnakeTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` that trains on the greedysnake engine when the DeepSpeed config's ``"greedysnake"``
    block enables it, and is plain SFTTrainer (under DeepSpeed) otherwise."""
