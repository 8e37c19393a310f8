"""initialize() refuses bad input before any DeepSpeed set-up, naming what is wrong."""
import json

import pytest
from torch import nn

import ds_greedysnake
from ds_greedysnake.models.gpt import GPTConfig, build_gpt, lm_loss
from helpers import ds_config


def test_unsplittable_model(tmp_path):
    with pytest.raises(ds_greedysnake.ModelSplitError, match="cannot split Linear"):
        ds_greedysnake.initialize(model=nn.Linear(4, 4), config=ds_config(str(tmp_path), 2), loss_fn=lm_loss)


def test_loss_fn_required(tmp_path):
    with pytest.raises(ValueError, match="loss_fn"):
        ds_greedysnake.initialize(model=build_gpt(GPTConfig(num_layers=1, hidden=32)),
                                  config=ds_config(str(tmp_path), 2))


def test_config_file_path_and_bad_stage(tmp_path):
    config = ds_config(str(tmp_path), 2)
    config["zero_optimization"]["stage"] = 1
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ds_greedysnake.GreedySnakeConfigError, match="got stage 1"):
        ds_greedysnake.initialize(model=build_gpt(GPTConfig(num_layers=1, hidden=32)), config=str(path),
                                  loss_fn=lm_loss)


def test_unknown_greedysnake_key(tmp_path):
    config = ds_config(str(tmp_path), 2, greedysnake={"alpah": 0.25})
    with pytest.raises(ds_greedysnake.GreedySnakeConfigError, match="alpah"):
        ds_greedysnake.initialize(model=build_gpt(GPTConfig(num_layers=1, hidden=32)), config=config, loss_fn=lm_loss)


def test_the_rank_device_is_selected_before_the_planner_probes(tmp_path, monkeypatch):
    import importlib
    initialize_module = importlib.import_module("ds_greedysnake.initialize")
    events = []

    class Accelerator:
        def device_name(self):
            return "cpu"

        def set_device(self, index):
            events.append(("set_device", index))

    class Planned(Exception):
        pass

    def plan(*args):
        events.append(("plan",))
        raise Planned

    monkeypatch.setattr(initialize_module, "get_accelerator", lambda: Accelerator())
    monkeypatch.setattr(initialize_module, "_apply_plan", plan)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(Planned):
        ds_greedysnake.initialize(model=build_gpt(GPTConfig(num_layers=1, hidden=32)),
                                  config=ds_config(str(tmp_path), 2, greedysnake={"auto": True}), loss_fn=lm_loss)
    assert events == [("set_device", 3), ("plan",)]
