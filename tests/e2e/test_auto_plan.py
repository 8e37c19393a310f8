"""``"auto": true`` at initialize: the plan applied and trained with (the planner's accuracy is judged in
tests/unit/planner/test_planner_accuracy.py on recorded runs, and live by scripts/bench/planner_accuracy.py)."""
import os

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_auto_plan_at_initialize(tmp_path):
    """``"auto": true`` with a hardware file: initialize applies the plan and the engine trains with it."""
    from greedysnake_run import make_engine
    from helpers import ds_config, tiny_gpt_config
    from ds_greedysnake.models.model_split import split_model
    from ds_greedysnake.models.gpt import build_gpt
    from ds_greedysnake.planner.auto import auto_plan
    from ds_greedysnake.settings import settings_from_ds_config, with_plan_applied
    hardware = os.path.join(REPO, "configs", "hardware", "a100_pcie4.json")
    block = {"auto": True, "plan_hardware": hardware, "plan_host_memory_gb": 2}
    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme)
    config = ds_config(nvme, 2, greedysnake=block)
    choice, plan, _ = auto_plan(settings_from_ds_config(config), split_model(build_gpt(tiny_gpt_config())), nvme)
    expected = with_plan_applied(config, choice.greedysnake, choice.gradient_accumulation_steps)
    engine, batches = make_engine(nvme, 2, greedysnake=block)
    try:
        assert engine.executor.deferred_layers == expected["greedysnake"]["deferred_layers"] == plan.deferred_layers
        assert engine.gradient_accumulation_steps() == 2  # fixed by ds_config: kept
        assert float(engine.train_batch(batches)) > 0
    finally:
        engine.close()
