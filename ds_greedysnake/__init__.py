"""ds_greedysnake: vertical (GreedySnake) scheduling for SSD-offloaded training on DeepSpeed."""
from .hf.accelerate_prepare import prepare
from .config import GreedySnakeConfig, GreedySnakeConfigError
from .initialize import from_pretrained, initialize
from .models.micro_batch import LossWithMetrics
from .models.model_split import ModelSplitError
from .models.pretrained import PretrainedWeightsError
from .models.weights import WeightsAccessError
from .models.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint,
                                  load_state_dict_from_zero_checkpoint)

__all__ = ["initialize", "prepare", "from_pretrained", "GreedySnakeConfig", "GreedySnakeConfigError", "ModelSplitError",
           "PretrainedWeightsError", "WeightsAccessError", "GreedySnakeTrainer", "GreedySnakeTrainerMixin",
           "GreedySnakeSFTTrainer", "LossWithMetrics",
           "get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]
__version__ = "0.1.0"

_HF_TRAINER_NAMES = ("GreedySnakeTrainer", "GreedySnakeTrainerMixin")


def __getattr__(name):
    # Imported on first use: transformers' Trainer (and accelerate) take seconds to import.
    if name in _HF_TRAINER_NAMES:
        from .hf import hf_trainer
        return getattr(hf_trainer, name)
    if name == "GreedySnakeSFTTrainer":  # needs trl: ds_greedysnake[trl]
        from .hf.sft_trainer import GreedySnakeSFTTrainer
        return GreedySnakeSFTTrainer
    raise AttributeError(f"module 'ds_greedysnake' has no attribute {name!r}")
