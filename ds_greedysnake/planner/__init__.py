"""The planner: a cost model of both engines, a search for M, the optimizer split and the data placement, its
CLI (cli.py). Imports runtime/ (the schedule), storage/, the base; optim/, models/ only inside a function."""
from .cost_model import StepPrediction, Workload, evaluate
from .engine_model import EngineSettings, engine_phases
from .errors import PlannerError
from .hardware import Hardware, LayerTimes, hardware_from_dict, load_hardware, save_hardware
from .plan_config import PlanRequest, plan_for_settings, workload_from_settings
from .search import BudgetTooSmall, Plan, search
from .shapes import NAMED_SHAPES, GPTShape, named_shape, parse_layers
from .zero_model import HorizontalSettings, horizontal_phases

__all__ = ["BudgetTooSmall", "EngineSettings", "GPTShape", "Hardware", "HorizontalSettings", "LayerTimes", "NAMED_SHAPES", "Plan",
           "PlanRequest", "PlannerError", "StepPrediction", "Workload", "engine_phases", "evaluate",
           "hardware_from_dict", "horizontal_phases", "load_hardware", "named_shape", "parse_layers",
           "plan_for_settings", "save_hardware", "search", "workload_from_settings"]
