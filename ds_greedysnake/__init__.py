"""ds_greedysnake: vertical (GreedySnake) scheduling for SSD-offloaded training on DeepSpeed."""
from .config import GreedySnakeConfig, GreedySnakeConfigError
from .initialize import initialize
from .model_split import ModelSplitError

__all__ = ["initialize", "GreedySnakeConfig", "GreedySnakeConfigError", "ModelSplitError"]
__version__ = "0.1.0"
