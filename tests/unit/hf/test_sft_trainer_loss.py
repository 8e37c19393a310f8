"""GreedySnakeSFTTrainer's pieces without a training run: SftLoss against SFTTrainer's own arithmetic on
the model's fused LM head, the metrics it appends, and what train() refuses."""
import copy
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from trl import SFTTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import ds_greedysnake  # noqa: E402
from ds_greedysnake.hf.hf_loss import LossScaling  # noqa: E402
from ds_greedysnake.hf.hf_trainer import GreedySnakeTrainerError  # noqa: E402
from ds_greedysnake.models.micro_batch import LossWithMetrics  # noqa: E402
from ds_greedysnake.models.hf import HeadHiddenStates, hf_layers  # noqa: E402
from ds_greedysnake.hf.sft_trainer import GreedySnakeSFTTrainer  # noqa: E402
from ds_greedysnake.hf.trl_sft import SftLoss, head_for_sft, record_metrics, sft_trainer_base  # noqa: E402
from helpers import ds_config  # noqa: E402
from hf_models import VOCAB, tiny_model  # noqa: E402


def test_importable_and_recognised():
    assert ds_greedysnake.GreedySnakeSFTTrainer is GreedySnakeSFTTrainer
    assert issubclass(GreedySnakeSFTTrainer, SFTTrainer)
    trainer = GreedySnakeSFTTrainer.__new__(GreedySnakeSFTTrainer)
    assert sft_trainer_base(trainer) is SFTTrainer
    assert sft_trainer_base(ds_greedysnake.GreedySnakeTrainer.__new__(ds_greedysnake.GreedySnakeTrainer)) is None


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2, 10), generator=generator)
    labels = input_ids.clone()
    labels[torch.rand(labels.shape, generator=generator) < 0.3] = -100
    return input_ids, labels


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
@pytest.mark.parametrize("items", [None, 23])
def test_sft_loss_is_sft_trainers(loss_type, items):
    """The head's hidden states through SftLoss give SFTTrainer.compute_loss's loss (the model's fused LM
    head, as SFTTrainer patches it) and the sums its metrics come from, with their gradients."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    add_fused_lm_head(reference, outputs=("log_probs", "entropy", "is_top1"))
    input_ids, labels = batch(0)
    outputs = reference(input_ids=input_ids, labels=labels, fused_lm_head=True, use_cache=False)
    per_token = -outputs.log_probs
    if loss_type == "dft":
        per_token = per_token * outputs.log_probs.exp().detach()
    count = outputs.label_mask.sum() if items is None else items
    expected = per_token.sum() / torch.as_tensor(count).clamp(min=1) * 2
    expected.backward()

    layers = hf_layers(model)
    layers[-1].returns_hidden_states = True
    hidden = input_ids
    for layer in layers:
        hidden = layer(hidden)
    assert isinstance(hidden, HeadHiddenStates)
    loss_fn = SftLoss(loss_type, VOCAB)
    loss_fn.configure(LossScaling(None if items is None else torch.tensor(items), multiplier=2))
    result = loss_fn(hidden, labels)
    assert isinstance(result, LossWithMetrics)
    assert torch.equal(result.loss, expected)
    assert torch.equal(result.metrics["num_valid"], outputs.label_mask.sum())
    assert torch.equal(result.metrics["num_correct"], outputs.is_top1.sum())
    assert torch.equal(result.metrics["entropy_sum"], outputs.entropy.detach().sum())
    result.loss.backward()
    got = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert torch.equal(got[name].grad, param.grad), name


def test_recorded_metrics_are_sft_trainers():
    """Per micro-batch, sum / count as float32, 0.0 with no counted token; num_tokens from the mask or the
    packed row's length, over the ranks."""
    trainer = SimpleNamespace(_metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                              _total_train_tokens=10, _tp_size=1,
                              accelerator=SimpleNamespace(gather_for_metrics=lambda tensor: tensor.reshape(1)))
    metrics = [{"num_valid": 7.0, "entropy_sum": 30.5, "num_correct": 3.0},
               {"num_valid": 0.0, "entropy_sum": 0.0, "num_correct": 0.0}]
    samples = [{"input_ids": torch.zeros(2, 5), "attention_mask": torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])},
               {"input_ids": torch.zeros(1, 9), "position_ids": torch.zeros(1, 9, dtype=torch.long)}]
    record_metrics(trainer, "train", metrics, samples)
    assert trainer._metrics["train"]["mean_token_accuracy"] == [(torch.tensor(3.0) / torch.tensor(7)).item(), 0.0]
    assert trainer._metrics["train"]["entropy"] == [(torch.tensor(30.5) / torch.tensor(7)).item(), 0.0]
    assert trainer._total_train_tokens == 10 + 8 + 9
    assert trainer._metrics["train"]["num_tokens"] == [27]
    record_metrics(trainer, "eval", metrics[:1], samples[:1])
    assert trainer._total_train_tokens == 27 and trainer._metrics["eval"]["num_tokens"] == [27]


def bare_sft_trainer(trainer_class=GreedySnakeSFTTrainer, **args):
    trainer = trainer_class.__new__(trainer_class)
    settings = dict(torch_compile=False, parallelism_config=None, max_grad_norm=1.0, loss_type="nll",
                    use_liger_kernel=False, activation_offloading=False)
    settings.update(args)
    trainer.__dict__.update(
        compute_loss_func=None, label_smoother=None, compute_metrics=None, preprocess_logits_for_metrics=None,
        neftune_noise_alpha=None, is_deepspeed_enabled=True, aux_loss_enabled=False,
        args=SimpleNamespace(**settings),
        accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
            deepspeed_config=ds_config("/tmp", 2)))))
    return trainer


def test_a_supported_set_up_passes():
    bare_sft_trainer()._refuse_unsupported()


@pytest.mark.parametrize("option,value,named", [("use_liger_kernel", True, "use_liger_kernel"),
                                                ("activation_offloading", True, "activation_offloading"),
                                                ("loss_type", "kto", "loss_type")])
def test_options_the_engine_cannot_run_are_named(option, value, named):
    with pytest.raises(GreedySnakeTrainerError, match=named):
        bare_sft_trainer(**{option: value})._refuse_unsupported()


def test_the_moe_aux_loss_is_named():
    trainer = bare_sft_trainer()
    trainer.aux_loss_enabled = True
    with pytest.raises(GreedySnakeTrainerError, match="aux loss"):
        trainer._refuse_unsupported()


class CustomSftLoss(GreedySnakeSFTTrainer):
    def compute_loss(self, model, inputs, **kwargs):
        return super().compute_loss(model, inputs, **kwargs)


def test_a_compute_loss_override_is_refused_naming_sft_trainer():
    with pytest.raises(GreedySnakeTrainerError, match="computes SFTTrainer's own loss"):
        bare_sft_trainer(CustomSftLoss)._refuse_unsupported()


def test_the_mixin_over_sft_trainer_is_recognised():
    class Mine(ds_greedysnake.GreedySnakeTrainerMixin, SFTTrainer):
        pass
    bare_sft_trainer(Mine)._refuse_unsupported()
    assert sft_trainer_base(Mine.__new__(Mine)) is SFTTrainer


def test_a_head_that_is_not_the_hf_split_is_refused():
    engine = SimpleNamespace(layers=[SimpleNamespace(module=torch.nn.Linear(2, 2))])
    with pytest.raises(GreedySnakeTrainerError, match="automatic Hugging Face split"):
        head_for_sft(engine, GreedySnakeTrainerError)
