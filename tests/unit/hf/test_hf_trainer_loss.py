"""GreedySnakeTrainer's pieces without a training run: the loss arithmetic against Trainer's, the
batch checks, the refusals at train(), and the routing of deepspeed.initialize."""
import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import deepspeed  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

import ds_greedysnake  # noqa: E402
from ds_greedysnake.config import GreedySnakeConfigError  # noqa: E402
from ds_greedysnake.deepspeed_compat import deepspeed_initialize_routed  # noqa: E402
from ds_greedysnake.hf.hf_trainer import (GreedySnakeTrainer, GreedySnakeTrainerError,  # noqa: E402
                                       GreedySnakeTrainerMixin, LossScaling, TrainerLoss, micro_batch)
from helpers import ds_config  # noqa: E402

VOCAB = 11


def test_importable_from_the_package():
    assert ds_greedysnake.GreedySnakeTrainer is GreedySnakeTrainer
    assert issubclass(GreedySnakeTrainer, Trainer) and issubclass(GreedySnakeTrainer, GreedySnakeTrainerMixin)


# ---------------------------------------------------------------- the loss: Trainer's arithmetic, the engine's


def trainer_stub(accepts_loss_kwargs=True, world_size=1, average_tokens=True, scaled_for_ga=None):
    return SimpleNamespace(model_accepts_loss_kwargs=accepts_loss_kwargs, loss_is_scaled_for_ga=scaled_for_ga,
                           accelerator=SimpleNamespace(num_processes=world_size),
                           args=SimpleNamespace(average_tokens_across_devices=average_tokens))


def window(world_size, num_micro_batches, seed=0):
    """logits (requiring grad) and labels, about 40% -100, per rank and micro-batch."""
    generator = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(world_size):
        rank = []
        for _ in range(num_micro_batches):
            logits = torch.randn(2, 6, VOCAB, generator=generator).requires_grad_(True)
            labels = torch.randint(0, VOCAB, (2, 6), generator=generator)
            labels[torch.rand(labels.shape, generator=generator) < 0.4] = -100
            rank.append((logits, labels))
        result.append(rank)
    return result


def num_items(micro_batches):
    """Trainer's count: labels other than -100 after the shift, over every rank's micro-batches."""
    return sum(labels[..., 1:].ne(-100).sum() for rank in micro_batches for _, labels in rank)


def trainer_objective(stub, micro_batches):
    """What Trainer logs for the window (sum over micro-batches, mean over ranks) and the objective whose
    gradient DeepSpeed applies (each rank's backpropagated sum, averaged over ranks)."""
    world_size, count = len(micro_batches), len(micro_batches[0])
    items = num_items(micro_batches) if stub.model_accepts_loss_kwargs else None
    total = 0
    for rank in micro_batches:
        for logits, labels in rank:
            # compute_loss: the model's loss (with num_items_in_batch when it takes it), times the ranks
            items_kwarg = {} if items is None else {"num_items_in_batch": items}
            loss = ForCausalLMLoss(logits, labels, VOCAB, **items_kwarg)
            if stub.args.average_tokens_across_devices and items is not None:
                loss = loss * stub.accelerator.num_processes
            scaled = stub.loss_is_scaled_for_ga if stub.loss_is_scaled_for_ga is not None else items is not None
            total = total + (loss if scaled else loss / count)  # training_step
    return total / world_size


def engine_objective(stub, micro_batches):
    """What the engine reports and backpropagates: the mean over ranks and micro-batches of loss_fn."""
    world_size, count = len(micro_batches), len(micro_batches[0])
    loss_fn = TrainerLoss(ForCausalLMLoss, VOCAB)
    items = num_items(micro_batches) if stub.model_accepts_loss_kwargs else None
    loss_fn.configure(GreedySnakeTrainerMixin._loss_scaling(stub, items, count))
    return sum(loss_fn(logits, labels) / count for rank in micro_batches for logits, labels in rank) / world_size


def gradients(objective, micro_batches):
    for rank in micro_batches:
        for logits, _ in rank:
            logits.grad = None
    objective.backward()
    return torch.cat([logits.grad.reshape(-1) for rank in micro_batches for logits, _ in rank])


@pytest.mark.parametrize("stub", [trainer_stub(), trainer_stub(world_size=2), trainer_stub(world_size=3),
                                  trainer_stub(accepts_loss_kwargs=False, world_size=2),
                                  trainer_stub(world_size=2, average_tokens=False),
                                  trainer_stub(world_size=2, scaled_for_ga=False)])
@pytest.mark.parametrize("count", [1, 3])
def test_engine_loss_is_trainers(stub, count):
    micro_batches = window(stub.accelerator.num_processes, count)
    expected = trainer_objective(stub, micro_batches)
    expected_grads = gradients(expected, micro_batches)
    got = engine_objective(stub, micro_batches)
    got_grads = gradients(got, micro_batches)
    assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert torch.allclose(got_grads, expected_grads, rtol=1e-5, atol=1e-9)


def test_the_token_mean_weighs_micro_batches_by_their_tokens():
    """With labels holding -100, Trainer's loss is the mean over every labelled token of the window and
    ranks, not the mean of the micro-batches' means; the engine's is the same."""
    stub = trainer_stub(world_size=2)
    micro_batches = window(2, 3, seed=1)
    token_losses = [ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=1) for rank in micro_batches
                    for logits, labels in rank]
    token_mean = float(sum(token_losses) / num_items(micro_batches))
    mean_of_means = sum(float(ForCausalLMLoss(logits, labels, VOCAB)) for rank in micro_batches
                        for logits, labels in rank) / 6
    assert float(engine_objective(stub, micro_batches)) == pytest.approx(token_mean, rel=1e-6)
    assert abs(mean_of_means - token_mean) > 1e-3  # the weighting matters for this data


def test_eval_loss_is_compute_losss():
    items = torch.tensor(17)
    assert GreedySnakeTrainerMixin._loss_scaling(trainer_stub(world_size=2), items, None) == LossScaling(items, 2)
    assert (GreedySnakeTrainerMixin._loss_scaling(trainer_stub(accepts_loss_kwargs=False), items, None)
            == LossScaling(None, 1))


# ---------------------------------------------------------------- batches


def batch(**extra):
    ids = torch.arange(8).view(2, 4)
    return dict({"input_ids": ids, "labels": ids.clone()}, **extra)


def test_micro_batch_takes_input_ids_and_labels():
    inputs, labels = micro_batch(batch(attention_mask=torch.ones(2, 4, dtype=torch.long)))
    assert torch.equal(inputs, batch()["input_ids"]) and torch.equal(labels, batch()["labels"])


def test_micro_batch_carries_a_padding_mask_and_position_ids_to_the_layers():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    inputs, labels = micro_batch(batch(attention_mask=mask))
    assert set(inputs) == {"input_ids", "attention_mask"} and torch.equal(inputs["attention_mask"], mask)
    positions = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])
    inputs, _ = micro_batch(batch(position_ids=positions, attention_mask=torch.ones(2, 4, dtype=torch.long)))
    assert set(inputs) == {"input_ids", "position_ids"}  # an all-ones mask: no padding, the causal mask alone


@pytest.mark.parametrize("sample,named", [
    (batch(token_type_ids=torch.zeros(2, 4, dtype=torch.long)), "token_type_ids"),
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, "labels"),
    (dict(batch(), labels=torch.zeros(2, 3, dtype=torch.long)), "shape"),
])
def test_micro_batch_refuses_what_the_model_would_compute_otherwise(sample, named):
    with pytest.raises(GreedySnakeTrainerError, match=named):
        micro_batch(sample)


# ---------------------------------------------------------------- refusals at train()


def bare_trainer(ds, trainer_class=GreedySnakeTrainer, **attributes):
    """A trainer object with just what the refusal checks read (Trainer's constructor not run)."""
    trainer = trainer_class.__new__(trainer_class)
    settings = dict(compute_loss_func=None, label_smoother=None, compute_metrics=None,
                    preprocess_logits_for_metrics=None, neftune_noise_alpha=None, is_deepspeed_enabled=True,
                    args=SimpleNamespace(torch_compile=False, parallelism_config=None, max_grad_norm=1.0),
                    accelerator=SimpleNamespace(state=SimpleNamespace(
                        deepspeed_plugin=SimpleNamespace(deepspeed_config=ds))))
    settings.update(attributes)
    trainer.__dict__.update(settings)
    return trainer


@pytest.fixture
def good(tmp_path):
    return ds_config(str(tmp_path), 3)


def test_a_supported_set_up_passes(good):
    trainer = bare_trainer(good)
    assert trainer.greedysnake_enabled()
    trainer._refuse_unsupported()


def test_the_block_off_is_plain_trainer(good):
    assert not bare_trainer(dict(good, greedysnake={"enabled": False})).greedysnake_enabled()
    assert not bare_trainer(good, is_deepspeed_enabled=False).greedysnake_enabled()


class CustomLoss(GreedySnakeTrainer):
    def compute_loss(self, model, inputs, **kwargs):
        return super().compute_loss(model, inputs, **kwargs)


class LaterTrainingStep(GreedySnakeTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.parametrize("trainer_class,named", [(CustomLoss, "overrides compute_loss"),
                                                 (LaterTrainingStep, "overrides training_step")])
def test_overrides_are_refused(good, trainer_class, named):
    with pytest.raises(GreedySnakeTrainerError, match=named):
        bare_trainer(good, trainer_class)._refuse_unsupported()


@pytest.mark.parametrize("attribute,value", [("compute_loss_func", lambda *a, **k: 0), ("label_smoother", object()),
                                             ("compute_metrics", lambda p: {}), ("neftune_noise_alpha", 5.0)])
def test_options_the_engine_cannot_run_are_named(good, attribute, value):
    option = "label_smoothing_factor" if attribute == "label_smoother" else attribute
    with pytest.raises(GreedySnakeTrainerError, match=option):
        bare_trainer(good, **{attribute: value})._refuse_unsupported()


def test_torch_compile_is_named(good):
    args = SimpleNamespace(torch_compile=True, parallelism_config=None, max_grad_norm=1.0)
    with pytest.raises(GreedySnakeTrainerError, match="torch_compile"):
        bare_trainer(good, args=args)._refuse_unsupported()


def test_fp16_is_refused_by_the_config_check(good):
    with pytest.raises(GreedySnakeConfigError, match="fp16"):
        bare_trainer(dict(good, fp16={"enabled": True}))._refuse_unsupported()


def test_missing_gradient_clipping_with_another_max_grad_norm_is_named(good):
    ds = copy.deepcopy(good)
    del ds["gradient_clipping"]
    args = SimpleNamespace(torch_compile=False, parallelism_config=None, max_grad_norm=0.5)
    with pytest.raises(GreedySnakeTrainerError, match="gradient_clipping.*auto"):
        bare_trainer(ds, args=args)._refuse_unsupported()
    bare_trainer(ds)._refuse_unsupported()  # max_grad_norm 1.0 is DeepSpeed's default: the same clipping


def test_evaluate_and_predict_before_or_without_the_engine_are_refused(good):
    trainer = bare_trainer(good, model_wrapped=None)
    with pytest.raises(GreedySnakeTrainerError, match="call train\\(\\) first"):
        trainer.evaluate()
    with pytest.raises(GreedySnakeTrainerError, match="predict\\(\\) needs logits"):
        trainer.predict(None)


# ---------------------------------------------------------------- the engine's construction


def test_deepspeed_initialize_is_routed_then_restored():
    original, calls = deepspeed.initialize, []

    def route(passed_original, *args, **kwargs):
        calls.append((passed_original, args, kwargs))
        return "engine"

    with deepspeed_initialize_routed(route):
        assert deepspeed.initialize(model="m", config_params={}) == "engine"
    assert deepspeed.initialize is original
    assert calls == [(original, (), {"model": "m", "config_params": {}})]
    with pytest.raises(KeyError):
        with deepspeed_initialize_routed(route):
            raise KeyError("inside")
    assert deepspeed.initialize is original


def test_only_this_trainers_model_gets_the_greedysnake_engine(good):
    trainer = bare_trainer(good, model=torch.nn.Linear(2, 2))
    other = torch.nn.Linear(2, 2)
    passed = []
    result = trainer._route_initialize(lambda **kwargs: passed.append(kwargs) or "deepspeed's", model=other)
    assert result == "deepspeed's" and passed == [{"model": other}]
    with pytest.raises(GreedySnakeTrainerError, match="optimizers="):
        trainer._route_initialize(None, model=trainer.model, optimizer=torch.optim.SGD(other.parameters(), lr=1))
