"""The planner's inputs: hardware files, model names, the CLI's errors and JSON, ``auto`` in the config."""
import json
import os

import pytest

from ds_greedysnake.planner import cli as plan_cli
from ds_greedysnake.planner.errors import PlannerError
from ds_greedysnake.planner.hardware import REQUIRED_FIELDS, hardware_from_dict, load_hardware
from ds_greedysnake.planner.shapes import NAMED_SHAPES, named_shape, parse_layers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
A100 = os.path.join(REPO, "configs", "hardware", "a100_pcie4.json")
CONFIG = os.path.join(REPO, "configs", "greedysnake_gpt_small.json")


def a100_dict():
    with open(A100) as handle:
        return json.load(handle)


def test_shipped_hardware_file_loads_with_every_assumption_stated():
    hardware = load_hardware(A100)
    assert hardware.host_device_bytes_per_s and hardware.source and len(hardware.notes) > 200


@pytest.mark.parametrize("missing", REQUIRED_FIELDS)
def test_hardware_missing_field_is_named(missing):
    data = a100_dict()
    del data[missing]
    with pytest.raises(PlannerError, match=f"missing the field\\(s\\) {missing}"):
        hardware_from_dict(data)


def test_hardware_bad_values(tmp_path):
    data = a100_dict()
    data["ssd_write_bytes_per_s"] = -1
    with pytest.raises(PlannerError, match="ssd_write_bytes_per_s must be a positive number, got -1"):
        hardware_from_dict(data)
    data = a100_dict()
    data["ssd_speed"] = 1
    with pytest.raises(PlannerError, match="unknown field\\(s\\) ssd_speed"):
        hardware_from_dict(data)
    broken = tmp_path / "broken.json"
    broken.write_text('{"name": ')
    with pytest.raises(PlannerError, match="not valid JSON"):
        load_hardware(str(broken))
    with pytest.raises(PlannerError, match="cannot read hardware file"):
        load_hardware(str(tmp_path / "absent.json"))


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(PlannerError) as raised:
        named_shape("gpt-7b")
    assert all(name in str(raised.value) for name in NAMED_SHAPES)


def test_layers_description():
    shape = parse_layers("blocks=8,hidden=512,heads=8,vocab=2048,seq_len=8")
    assert shape.params == named_shape("ab-ssd-bound").params
    with pytest.raises(PlannerError, match="missing seq_len"):
        parse_layers("blocks=2,hidden=1024,heads=8,vocab=2048")
    with pytest.raises(PlannerError, match="not KEY=VALUE"):
        parse_layers("blocks=2,width=3")
    with pytest.raises(PlannerError, match="not an integer"):
        parse_layers("blocks=two,hidden=1024,heads=8,vocab=2048,seq_len=32")


def run_cli(capsys, *args):
    code = plan_cli.main(["--config", CONFIG, "--hardware", A100, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_text_and_json(capsys):
    code, out, _ = run_cli(capsys, "--model", "gpt-small", "--host-memory", "8")
    assert code == 0
    assert '"greedysnake": {"enabled": true' in out and "ZeRO-Infinity:" in out and "binds:" in out
    assert "not implemented" in out
    code, out, _ = run_cli(capsys, "--model", "gpt-small", "--host-memory", "8", "--json", "--micro-batches", "2", "8")
    assert code == 0
    report = json.loads(out)
    assert [p["micro_batches"] for p in report["plans"]] == [2, 8]
    recommended = report["recommended"]
    assert recommended["greedysnake_block"]["enabled"] is True
    assert recommended["greedysnake"]["seconds"] > 0 and recommended["zero_infinity"]["seconds"] > 0


def test_cli_errors(capsys):
    code, _, err = run_cli(capsys, "--model", "gpt-7b")
    assert code == 2 and "unknown model 'gpt-7b'" in err and "gpt-65b" in err
    code, _, err = run_cli(capsys, "--model", "gpt-65b", "--host-memory", "1")
    assert code == 2 and "below the smallest any plan needs" in err and "--host-memory" in err
    code = plan_cli.main(["--config", CONFIG, "--hardware", "/nonexistent.json"])
    assert code == 2 and "cannot read hardware file" in capsys.readouterr().err
    code, _, err = run_cli(capsys, "--zero-probe-processes", "0")
    assert code == 2 and "--zero-probe-processes 0" in err and "--no-zero-probe" in err


def test_paper_projection_favours_greedysnake(capsys):
    code, out, _ = run_cli(capsys, "--model", "gpt-65b", "--json", "--micro-batches", "64")
    plan = json.loads(out)["recommended"]
    assert plan["zero_infinity"]["seconds"] > plan["greedysnake"]["seconds"]


def test_auto_fields_and_shape_of_the_built_in_gpt():
    from ds_greedysnake.config import parse_greedysnake_config
    from ds_greedysnake.models.model_split import split_model
    from ds_greedysnake.models.gpt import GPTConfig, build_gpt
    from ds_greedysnake.planner.auto import shape_of
    config = parse_greedysnake_config({"greedysnake": {"enabled": True, "auto": True, "plan_host_memory_gb": 4}})
    assert config.auto and config.plan_host_memory_gb == 4
    shape = shape_of(split_model(build_gpt(GPTConfig(vocab_size=300, seq_len=16, hidden=64, num_heads=4, num_layers=3))))
    assert (shape.num_blocks, shape.hidden, shape.heads, shape.vocab, shape.seq_len) == (3, 64, 4, 300, 16)


def test_auto_plan_applies_only_engine_placements(tmp_path):
    from ds_greedysnake.models.model_split import split_model
    from ds_greedysnake.models.gpt import GPTConfig, build_gpt
    from ds_greedysnake.planner.auto import auto_plan
    from ds_greedysnake.settings import settings_from_ds_config, with_plan_applied
    modules = split_model(build_gpt(GPTConfig(vocab_size=256, seq_len=16, hidden=64, num_heads=4, num_layers=4)))
    config = {"train_micro_batch_size_per_gpu": 2,
              "greedysnake": {"enabled": True, "auto": True, "plan_hardware": A100, "plan_host_memory_gb": 1,
                              "deferred_layers": 2}}
    choice, plan, lines = auto_plan(settings_from_ds_config(config), modules, str(tmp_path))
    applied = with_plan_applied(config, choice.greedysnake, choice.gradient_accumulation_steps)
    assert applied["greedysnake"]["deferred_layers"] == 2  # set by the user: kept
    for key in ("activation_host_memory_mb", "gradient_host_memory_mb", "optimizer_host_memory_mb"):
        assert applied["greedysnake"][key] == plan.greedysnake_block()[key]
    assert applied["gradient_accumulation_steps"] == plan.micro_batches  # no batch size fixed, one rank
    assert plan.shares["param"] == 0 and plan.shares["opt"] == 0
    assert any("not applied" in line for line in lines) and "gradient_accumulation_steps" not in config
    fixed = dict(config, gradient_accumulation_steps=3)
    choice, plan, _ = auto_plan(settings_from_ds_config(fixed), modules, str(tmp_path))
    applied = with_plan_applied(fixed, choice.greedysnake, choice.gradient_accumulation_steps)
    assert applied["gradient_accumulation_steps"] == 3 and plan.micro_batches == 3


def test_auto_plan_refuses_other_models(tmp_path):
    from torch import nn
    from ds_greedysnake.planner.auto import auto_plan
    from ds_greedysnake.settings import settings_from_ds_config
    with pytest.raises(PlannerError, match="built-in GPT"):
        auto_plan(settings_from_ds_config({"greedysnake": {"auto": True}}), [nn.Linear(2, 2)] * 3, str(tmp_path))


def test_lora_ssd_space_is_the_adapters_plus_one_copy_of_the_base(capsys):
    """--lora R: every base weight frozen (one region of the compute dtype, nothing else), adapters trained."""
    from ds_greedysnake.planner.shapes import lora_numels
    shape = named_shape("gpt-small")
    code, out, _ = run_cli(capsys, "--model", "gpt-small", "--json", "--lora", "8")
    assert code == 0
    report = json.loads(out)
    needed = report["ssd_bytes"]
    full = json.loads(run_cli(capsys, "--model", "gpt-small", "--json")[1])["ssd_bytes"]
    base_bytes = 4 * shape.params  # the config trains in fp32
    assert report["lora_rank"] == 8 and full["frozen parameters"] == 0
    assert base_bytes <= needed["frozen parameters"] < base_bytes + 4096 * len(shape.layers)
    adapters = sum(trainable for trainable, _ in lora_numels(shape, 8))
    assert adapters == 8 * 16 * shape.hidden * shape.num_blocks
    assert 0 < needed["parameters"] < full["parameters"] / 10 and needed["optimizer states"] <= full["optimizer states"]
    code, out, _ = run_cli(capsys, "--model", "gpt-small", "--lora", "8")
    assert code == 0 and "bytes per base parameter" in out and "bytes per adapter parameter" in out
    code, _, err = run_cli(capsys, "--model", "gpt-small", "--lora", "0")
    assert code == 2 and "LoRA rank must be a positive integer, got 0" in err
