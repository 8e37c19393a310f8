"""ds_greedysnake: vertical (GreedySnake) scheduling for SSD-offloaded training on DeepSpeed."""
from .config import GreedySnakeConfig, GreedySnakeConfigError
from .initialize import initialize
from .model_split import ModelSplitError
from .pretrained import PretrainedWeightsError, from_pretrained
from .weights import WeightsAccessError

__all__ = ["initialize", "from_pretrained", "GreedySnakeConfig", "GreedySnakeConfigError", "ModelSplitError",
           "PretrainedWeightsError", "WeightsAccessError"]
__version__ = "0.1.0"
