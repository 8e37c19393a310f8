"""ds_greedysnake.prepare's refusals, before any engine is built (its round trip:
tests/e2e/test_accelerate_state.py)."""
import types

import pytest
import torch

from ds_greedysnake.hf.accelerate_prepare import initialize_for_accelerate, prepare


def test_prepare_without_a_deepspeed_plugin_names_it():
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=None))
    with pytest.raises(ValueError, match=r"DeepSpeedPlugin\(hf_ds_config="):
        prepare(accelerator, torch.nn.Linear(2, 2), loss_fn=lambda output, labels: output.sum())


def test_prepare_takes_one_model():
    plugin = types.SimpleNamespace(deepspeed_config={"greedysnake": {"enabled": True}})
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin))
    with pytest.raises(ValueError, match="takes one model \\(got 2\\)"):
        prepare(accelerator, torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), loss_fn=lambda output, labels: 0)


@pytest.mark.parametrize("kwargs, message", [
    ({"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)}, "DummyOptim"),
    ({"mpu": object()}, "sequence or tensor parallelism"),
    ({"dist_init_required": True}, r"\['dist_init_required'\]"),
])
def test_what_the_engine_cannot_take_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        initialize_for_accelerate(dict(model=torch.nn.Linear(2, 2), config_params={}, **kwargs), lambda o, l: 0)
