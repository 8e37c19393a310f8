"""The engine's per-micro-batch metrics (micro_batch.LossWithMetrics) and side inputs, on the tiny GPT:
what loss_fn returns beside the loss comes back per micro-batch, read with the losses; inputs may be a
dict; a side input no layer reads is refused before the step."""
import copy
import itertools

import pytest
import torch

from ds_greedysnake import LossWithMetrics, initialize
from ds_greedysnake.models.gpt import lm_loss
from helpers import data, ds_config, fresh_model, tiny_gpt_config

pytestmark = pytest.mark.slow
HIDDEN, MICRO_BATCHES = 64, 3


def with_metrics(output, labels):
    return LossWithMetrics(lm_loss(output, labels), {"labels": (labels >= 0).sum(),
                                                     "logit_sum": output.detach().double().sum()})


def expected_metrics(model, batches):
    with torch.no_grad():
        return [{"labels": float((labels >= 0).sum()), "logit_sum": float(model(inputs).double().sum())}
                for inputs, labels in batches]


def assert_close(got, expected):
    assert [sorted(each) for each in got] == [sorted(each) for each in expected]
    for mine, theirs in zip(got, expected):
        assert mine["labels"] == theirs["labels"]
        assert mine["logit_sum"] == pytest.approx(theirs["logit_sum"], rel=1e-5)


def test_metrics_come_back_per_micro_batch_and_side_inputs_are_checked(tmp_path):
    config = tiny_gpt_config(HIDDEN)
    model = fresh_model(config)
    reference = copy.deepcopy(model)
    engine, _, _, _ = initialize(model=model, config=ds_config(str(tmp_path), MICRO_BATCHES), loss_fn=with_metrics)
    try:
        batches = list(itertools.islice(data(config), 2 * MICRO_BATCHES))
        # A dict of the first layer's input works as the tensor does; a side input no layer reads does not.
        with pytest.raises(ValueError, match=r"\['attention_mask'\].*no layer"):
            engine.train_batch(iter([({"input_ids": inputs, "attention_mask": torch.ones_like(inputs)}, labels)
                                     for inputs, labels in batches[:MICRO_BATCHES]]))
        assert engine.global_steps == 0
        engine.train_batch(iter([({"input_ids": inputs}, labels) for inputs, labels in batches[:MICRO_BATCHES]]))
        assert engine.last_step_metrics.tokens == sum(inputs.numel() for inputs, _ in batches[:MICRO_BATCHES])
        # The step's metrics were computed with the weights before its update: the reference's.
        assert_close(engine.last_micro_batch_metrics, expected_metrics(reference, batches[:MICRO_BATCHES]))
        engine.eval_batch(iter(batches[MICRO_BATCHES:]))
        updated = copy.deepcopy(reference)
        loaded = updated.load_state_dict({name: value.to(updated.state_dict()[name].dtype)
                                          for name, value in engine.master_parameters().items()}, strict=False)
        assert not loaded.missing_keys and not loaded.unexpected_keys
        assert_close(engine.last_micro_batch_metrics, expected_metrics(updated, batches[MICRO_BATCHES:]))
    finally:
        engine.close()
