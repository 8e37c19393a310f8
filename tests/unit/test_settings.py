"""ds_config is parsed once, at the entry points, into ``settings.Settings``; nothing below reads the dict.

Two checks (issue 32): a scan of the package's source (``ast``) for reads of a ds_config dict outside the
entry points, and an engine built through ``initialize`` and trained a step with every raw-dict reader
refusing to run once the settings are built.
"""
import ast
import os
from typing import Dict, List, Set

import pytest

from ds_greedysnake import config as config_module
from ds_greedysnake import deepspeed_compat
from ds_greedysnake import settings as settings_module
from ds_greedysnake.settings import settings_from_ds_config

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ds_greedysnake")

# Names a ds_config dict goes by: ours, DeepSpeed's (``engine._config._param_dict``) and accelerate's
# (``DeepSpeedPlugin.deepspeed_config``, ``deepspeed.initialize(config_params=...)``).
RAW_NAMES = {"ds_config", "ds_config_dict", "param_dict", "_param_dict", "deepspeed_config", "config_params"}
# Functions that take a whole ds_config dict: only the entry points call them.
RAW_READERS = {"settings_from_ds_config", "parse_greedysnake_config", "check_ds_config", "load_config",
               "get_aio_config", "aio_settings", "parsed_ds_config", "bf16_enabled", "with_plan_applied"}
# The entry points, as (module, function): where a ds_config dict may be read.
ENTRY_POINTS: Dict[str, Set[str]] = {
    "initialize.py": {"*"},              # parses the config once, hands DeepSpeed its dict
    "settings.py": {"*"},                # the one reader
    "config.py": {"parse_greedysnake_config", "check_ds_config"},  # the block's parser, the checks at initialize
    "deepspeed_compat.py": {"aio_settings", "parsed_ds_config"},   # DeepSpeed's own parsers (its internals)
    # The planner's CLI; its probe hands the whole dict to DeepSpeed's own engine for the ZeRO-3 probe, which
    # runs ZeRO-Infinity as the user's config would (as initialize hands DeepSpeed its dict).
    "planner/cli.py": {"_load_settings", "_hardware"},
    "planner/zero_probe.py": {"*"},
    # Trainer's and accelerate's way in: accelerate's dict is checked before initialize gets it.
    "hf/hf_trainer.py": {"greedysnake_enabled", "_ds_config", "_refuse_unsupported"},
    "hf/accelerate_prepare.py": {"prepare"},
}


def _raw_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name) and node.id in RAW_NAMES:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in RAW_NAMES:
        return node.attr
    return ""


class _Reads(ast.NodeVisitor):
    """Every read of a ds_config dict in one module, outside its allowed functions."""

    def __init__(self, allowed: Set[str]):
        self.allowed, self.functions, self.found = allowed, [], []

    def _note(self, node: ast.AST, what: str) -> None:
        if "*" not in self.allowed and not self.allowed & set(self.functions):
            where = ".".join(self.functions) or "<module>"
            self.found.append(f"line {node.lineno} in {where}: {what}")

    def visit_FunctionDef(self, node) -> None:
        self.functions.append(node.name)
        for argument in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
            if argument.arg in RAW_NAMES:
                self._note(node, f"takes a dict argument {argument.arg!r}")
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if _raw_name(node.value):
            self._note(node, f"indexes {_raw_name(node.value)}[...]")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in RAW_NAMES - {"ds_config"}:
            self._note(node, f"reads .{node.attr}")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(map(_raw_name, node.comparators)):
            self._note(node, "tests a key in a ds_config dict")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", "")
        if isinstance(function, ast.Attribute) and _raw_name(function.value):
            self._note(node, f"calls {_raw_name(function.value)}.{function.attr}(...)")
        elif name in RAW_READERS:
            self._note(node, f"calls {name}(...)")
        self.generic_visit(node)


def raw_config_reads(package: str) -> List[str]:
    """``module: line in function: what`` for each read of a ds_config dict below the entry points."""
    found = []
    for folder, _, files in os.walk(package):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path, package)
            with open(path) as handle:
                tree = ast.parse(handle.read(), path)
            # By file name too: a module moved into a subpackage keeps its entry points.
            reads = _Reads(ENTRY_POINTS.get(module, ENTRY_POINTS.get(name, set())))
            reads.visit(tree)
            found += [f"{module}: {line}" for line in reads.found]
    return found


def test_no_module_below_the_entry_points_reads_a_ds_config_dict():
    found = raw_config_reads(PACKAGE)
    assert not found, ("these read a ds_config dict; take the settings (ds_greedysnake/settings.py) or the part "
                       "needed instead:\n" + "\n".join(found))


def test_the_scan_finds_each_kind_of_read(tmp_path):
    (tmp_path / "below.py").write_text(
        "def f(ds_config):\n    return ds_config['optimizer']\n"
        "def g(engine):\n    return engine.ds_config_dict.get('aio')\n"
        "def h(store):\n    return store.ds_config.get('aio', {}), 'bf16' in store.ds_config\n"
        "def i(block):\n    return parse_greedysnake_config(block)\n")
    (tmp_path / "initialize.py").write_text("def f(ds_config):\n    return ds_config['optimizer']\n")
    found = raw_config_reads(str(tmp_path))
    assert all(line.startswith("below.py") for line in found)
    assert [line.split(": ", 2)[2] for line in found] == [
        "takes a dict argument 'ds_config'", "indexes ds_config[...]", "calls ds_config_dict.get(...)",
        "reads .ds_config_dict", "calls ds_config.get(...)", "tests a key in a ds_config dict",
        "calls parse_greedysnake_config(...)"]


def test_settings_keep_each_readers_defaults():
    settings = settings_from_ds_config({})
    assert settings.greedysnake == config_module.parse_greedysnake_config({})
    assert settings.aio.as_dict() == deepspeed_compat.AioSettings().as_dict() == dict(
        deepspeed_compat.get_aio_config({}))
    assert settings.gradient_clipping == deepspeed_compat.default_gradient_clipping()
    assert (settings.micro_batch_size, settings.micro_batches, settings.batch_size_fixed) == (1, 1, False)
    assert not settings.bf16 and settings.optimizer.params_dict() == {}
    given = settings_from_ds_config({
        "gradient_clipping": None, "train_batch_size": 8, "bf16": {"enabled": True},
        "aio": {"queue_depth": 32}, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
        "zero_optimization": {"offload_param": {"nvme_path": "/ssd"}, "reduce_bucket_size": 11},
        "greedysnake": {"deferred_layers": 2}})
    assert given.gradient_clipping == 0.0 and given.batch_size_fixed and given.bf16
    assert given.aio.queue_depth == 32 and given.aio.block_size == deepspeed_compat.AioSettings().block_size
    assert (given.optimizer.type, given.optimizer.params_dict()) == ("AdamW", {"lr": 0.5})
    assert (given.zero.nvme_path, given.zero.reduce_bucket_size, given.zero.max_live_parameters) == ("/ssd", 11, 1e9)
    changed = given.with_greedysnake(activation_host_memory_mb=3)
    assert (changed.greedysnake.deferred_layers, changed.greedysnake.activation_host_memory_mb) == (2, 3)
    assert given.greedysnake.activation_host_memory_mb == 4096  # frozen: a new object, the old one unchanged


def test_the_settings_are_frozen_down_to_the_greedysnake_block():
    """One parsed copy shared by every module: no module can change a value under the others."""
    import dataclasses

    settings = settings_from_ds_config({"greedysnake": {"enabled": True, "activation_host_memory_mb": 64}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.gradient_clipping = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.aio.block_size = 1
    with pytest.raises(ValueError, match="frozen"):
        settings.greedysnake.activation_host_memory_mb = 1.0
    changed = settings.with_greedysnake(activation_host_memory_mb=1.0)
    assert (changed.greedysnake.activation_host_memory_mb, settings.greedysnake.activation_host_memory_mb) == (1.0, 64)


def test_the_zero_numbers_are_deepspeeds_own():
    """Absent, each ZeRO number the planner reads is what DeepSpeed's ZeRO config model parses; written, it
    is the written value (under DeepSpeed's stage3_ key)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    parsed = DeepSpeedZeroConfig(stage=3)
    absent = settings_from_ds_config({}).zero
    for name in deepspeed_compat.ZERO_PLANNER_FIELDS:
        assert getattr(absent, name) == float(getattr(parsed, name)), name
    written = settings_from_ds_config({"zero_optimization": {"stage3_prefetch_bucket_size": 123,
                                                             "reduce_bucket_size": 456}}).zero
    assert (written.prefetch_bucket_size, written.reduce_bucket_size) == (123.0, 456.0)


def test_bad_input_fails_as_the_block_parser_does():
    with pytest.raises(config_module.GreedySnakeConfigError, match="alpah"):
        settings_from_ds_config({"greedysnake": {"alpah": 1}})
    with pytest.raises(config_module.GreedySnakeConfigError, match="must be an object"):
        settings_from_ds_config({"greedysnake": True})
    with pytest.raises(config_module.GreedySnakeConfigError, match="gradient_clipping must be a number, got 'auto'"):
        settings_from_ds_config({"gradient_clipping": "auto"})


def test_an_engine_trains_with_the_settings_as_the_only_parsed_copy(tmp_path, monkeypatch):
    """initialize parses the config once; every raw-dict reader then refuses to run, through engine
    construction and a training step (the optimizer worker gets the aio settings, not the dict)."""
    import importlib
    import ds_greedysnake
    from ds_greedysnake.hf import accelerate_prepare, hf_trainer
    from ds_greedysnake.models.gpt import GPTConfig, build_gpt, lm_loss
    from helpers import data, ds_config
    initialize_module = importlib.import_module("ds_greedysnake.initialize")
    built = []

    def refuse(name):
        def refused(*args, **kwargs):
            raise AssertionError(f"{name} read a ds_config dict after initialize parsed it")
        return refused

    def parse_once(ds_config_dict):
        assert not built, "initialize parsed the config twice"
        built.append(settings_from_ds_config(ds_config_dict))
        for module, name in ((config_module, "parse_greedysnake_config"), (config_module, "parse_greedysnake_block"),
                             (settings_module, "parse_greedysnake_block"), (settings_module, "aio_settings"),
                             (deepspeed_compat, "aio_settings"), (settings_module, "settings_from_ds_config"),
                             (initialize_module, "bf16_enabled"), (hf_trainer, "parse_greedysnake_config"),
                             (accelerate_prepare, "parse_greedysnake_config")):
            monkeypatch.setattr(module, name, refuse(name))
        return built[0]

    model_config = GPTConfig(vocab_size=64, seq_len=8, hidden=32, num_heads=2, num_layers=2)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = ds_config(str(nvme), 2)
    # The vertical engine's checks of the dict (config.check_ds_config) run at initialize after the settings
    # are built; run here first, so that nothing reads the dict once they are.
    nvme_path = initialize_module.check_ds_config(config, "cpu")
    monkeypatch.setattr(initialize_module, "check_ds_config", lambda *args: nvme_path)
    monkeypatch.setattr(initialize_module, "settings_from_ds_config", parse_once)
    engine, *_ = ds_greedysnake.initialize(model=build_gpt(model_config), config=config, loss_fn=lm_loss)
    try:
        assert engine.settings is built[0] and len(built) == 1
        assert not hasattr(engine, "ds_config_dict")
        loss = float(engine.train_batch(data(model_config)))
        assert loss > 0 and engine.global_steps == 1
    finally:
        engine.close()
