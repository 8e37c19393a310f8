"""Hugging Face ``Trainer`` on the greedysnake engine: ``GreedySnakeTrainer`` and its mixin.

A Trainer script with a ZeRO-Infinity ``deepspeed=`` config switches by importing GreedySnakeTrainer
instead of Trainer and adding ``"greedysnake": {"enabled": true}`` to the config; with the block off
(or absent) the class is Trainer under DeepSpeed, unchanged. How it fits Trainer (transformers 5.24,
accelerate 1.15):

* The engine: during ``train()``, accelerate's call of ``deepspeed.initialize`` for this trainer's model
  goes to ``ds_greedysnake.initialize`` (``deepspeed_compat.deepspeed_initialize_routed``). Trainer's
  ds_config processing ("auto" values), its lr scheduler (handed over as a callable) and accelerate's
  wrappers stay as they are; ``grad_norm``, ``save_model``, checkpoints and resuming reach the engine
  through DeepSpeed's API, as they do for ZeRO-Infinity.
* The step: Trainer fetches an accumulation window up front (``get_batch_samples``), then calls
  ``training_step`` once per micro-batch. At the window's first micro-batch the whole window runs as
  one ``engine.train_batch`` (the last window of an epoch may be shorter); each ``training_step`` then
  returns the window's loss divided by its number of micro-batches, so what Trainer adds up and logs
  per step is the window's loss. (A callback that stops training between two micro-batches of a window
  therefore stops it after that window's step, where plain Trainer would drop the window.)
* The loss: Trainer's own (``TrainerLoss``), the model's ``loss_function`` on the logits with what
  ``compute_loss`` and ``training_step`` would give it: ``num_items_in_batch`` (a token mean over the
  window and the ranks, when labels hold -100) or a per-micro-batch mean over the window length.
* The batch: input_ids and labels, with a padding mask and (packed) position ids as side inputs that
  every layer applies as the model's forward does (micro_batch.py); other inputs are refused.
* SFTTrainer (trl): its loss and metrics instead, from the head layer's final hidden states (trl_sft.py).
* Evaluation: ``prediction_step`` runs each eval batch forward through the engine (the module's own
  parameters are empty placeholders between layer fetches) with Trainer's eval loss; loss only, so
  ``compute_metrics`` and ``predict()`` are refused.
"""
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from deepspeed.accelerator import get_accelerator
from transformers import Trainer

from .accelerate_prepare import (count_ranks_on_the_cpu, initialize_for_accelerate,
                                 refuse_what_the_engine_cannot_take)
from ..config import check_ds_config, parse_greedysnake_config
from ..deepspeed_compat import (default_gradient_clipping, deepspeed_initialize_routed, logical_shape,
                                remove_shm_buffer_at_exit)
from ..runtime.engine import GreedySnakeEngine
from .hf_loss import LossScaling, TrainerLoss
from . import trl_sft

logger = logging.getLogger(__name__)

INPUT_KEYS = ("input_ids", "labels")
# What the Hugging Face split's layers read besides input_ids (models/hf.py), as a collator gives them: a
# padding mask (padded batches), position ids restarting per sequence and the varlen kernels' bounds
# (padding-free, packed batches).
SIDE_INPUT_KEYS = ("attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                   "max_length_k", "seq_idx")
# Methods the mixin implements that a class later in the MRO must not override.
_MIXIN_METHODS = ("training_step", "get_batch_samples", "prediction_step")


class GreedySnakeTrainerError(ValueError):
    """A Trainer setting or batch the greedysnake engine cannot train; the message names it and the fix."""


def micro_batch(sample: Dict[str, Any]) -> Tuple[Any, torch.Tensor]:
    """``(inputs, labels)`` of one Trainer batch for the engine: inputs are the input_ids, or a dict of them
    and the side inputs the model's split reads (a padding mask, packed position ids and the varlen
    kernels' sequence bounds; micro_batch.py). Refuses other inputs and missing labels."""
    unknown = sorted(set(sample) - set(INPUT_KEYS) - set(SIDE_INPUT_KEYS))
    if unknown:
        raise GreedySnakeTrainerError(
            f"the batch has inputs {unknown}, which greedysnake does not pass to the model (its layers take "
            f"input_ids and {list(SIDE_INPUT_KEYS)}; the loss comes from labels): drop them from the dataset or "
            "the data collator")
    missing = [key for key in ("input_ids", "labels") if key not in sample]
    if missing:
        raise GreedySnakeTrainerError(f"the batch has no {missing}: greedysnake trains causal LMs on input_ids "
                                      "with labels (e.g. DataCollatorForLanguageModeling(mlm=False))")
    input_ids, labels = sample["input_ids"], sample["labels"]
    if labels.shape != input_ids.shape:
        raise GreedySnakeTrainerError(f"labels have shape {tuple(labels.shape)} but input_ids "
                                      f"{tuple(input_ids.shape)}: give one label per input token (-100 where no "
                                      "loss is wanted)")
    side = {key: sample[key] for key in SIDE_INPUT_KEYS if sample.get(key) is not None}
    mask = side.get("attention_mask")
    if mask is not None and bool(mask.all()):
        del side["attention_mask"]  # no padding: the causal mask alone, as the model computes it then
    if not side:
        return input_ids, labels
    return dict(side, input_ids=input_ids), labels


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """PreTrainedModel.num_parameters(exclude_embeddings=True), also for a model built under zero.Init."""
    embeddings = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)}
    return sum(logical_shape(param).numel() for name, param in model.named_parameters() if name not in embeddings)


def count_every_rank_on_the_cpu(training_args) -> None:
    """Give accelerate the number of ranks DeepSpeed runs on the CPU accelerator (accelerate_prepare.py)."""
    if getattr(training_args, "deepspeed_plugin", None) is None or get_accelerator().device_name() != "cpu":
        return
    training_args.device  # sets up accelerate's state (and DeepSpeed's process group)
    count_ranks_on_the_cpu()


@dataclass
class _Window:
    """The micro-batches Trainer fetched for one optimizer step, and how far training_step got in them."""
    samples: List[Dict[str, Any]]
    num_items_in_batch: Any
    position: int = 0
    loss_per_micro_batch: Optional[torch.Tensor] = None

    def is_next(self, inputs) -> bool:
        return self.position < len(self.samples) and self.samples[self.position] is inputs


class GreedySnakeTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass in the bases (``class T(GreedySnakeTrainerMixin,
    SomeTrainer)``): when the DeepSpeed config's ``"greedysnake"`` block enables it, ``train()`` runs on
    the greedysnake engine; otherwise the class is that Trainer."""

    _greedysnake_window: Optional[_Window] = None
    _greedysnake_loss: Optional[TrainerLoss] = None
    _greedysnake_step_lr: Optional[float] = None
    _greedysnake_flops_parameters: int = 0

    # ------------------------------------------------------------------ set-up

    def __init__(self, *args, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "deepspeed_plugin", None) is not None:
            count_every_rank_on_the_cpu(training_args)
            remove_shm_buffer_at_exit()  # with the block off too, where ds_greedysnake.initialize is not called
        super().__init__(*args, **kwargs)

    def greedysnake_enabled(self) -> bool:
        """Whether DeepSpeed is on and its config's "greedysnake" block enables the engine."""
        if not getattr(self, "is_deepspeed_enabled", False):
            return False
        return parse_greedysnake_config(self._ds_config()).enabled

    def _ds_config(self) -> Dict[str, Any]:
        return self.accelerator.state.deepspeed_plugin.deepspeed_config

    def _greedysnake_engine(self) -> Optional[GreedySnakeEngine]:
        engine = getattr(self, "model_wrapped", None)
        return engine if isinstance(engine, GreedySnakeEngine) else None

    def train(self, *args, **kwargs):
        if not self.greedysnake_enabled():
            return super().train(*args, **kwargs)
        if self._greedysnake_engine() is not None:
            raise GreedySnakeTrainerError("train() runs once per GreedySnakeTrainer (its engine holds the SSD folder): "
                                          "to train on, make a new trainer and pass resume_from_checkpoint")
        self._refuse_unsupported()
        with deepspeed_initialize_routed(self._route_initialize):
            return super().train(*args, **kwargs)

    def _route_initialize(self, original: Callable, *args, **kwargs):
        """accelerate's deepspeed.initialize call for this trainer's model builds the greedysnake engine."""
        model = kwargs.get("model")
        if args or model is None or model is not self.model:
            return original(*args, **kwargs)  # another model (a reference model, say): DeepSpeed's engine
        refuse_what_the_engine_cannot_take(kwargs, GreedySnakeTrainerError)
        if getattr(model, "is_activation_checkpointing", False):
            # The engine recomputes every layer in its backward already; HF's checkpointing would do it twice.
            model.activation_checkpointing_disable()
            logger.info("greedysnake recomputes each layer in backward itself: the model's activation "
                        "checkpointing is turned off")
        if getattr(model, "_require_grads_hook", None) is not None:
            # Set for checkpointing with frozen embeddings (PEFT): it would make every input embedding
            # require a gradient, which the engine neither needs nor computes below its lowest trainable layer.
            model.disable_input_require_grads()
        sft = trl_sft.sft_trainer_base(self) is not None
        if sft:
            self._greedysnake_loss = trl_sft.SftLoss(self.args.loss_type, model.config.vocab_size)
        else:
            self._greedysnake_loss = TrainerLoss(model.loss_function, model.config.vocab_size)
        self._greedysnake_flops_parameters = non_embedding_parameters(model)
        prepared = initialize_for_accelerate(kwargs, self._greedysnake_loss, GreedySnakeTrainerError)
        if sft:
            trl_sft.head_for_sft(prepared[0], GreedySnakeTrainerError)
        return prepared

    def _refuse_unsupported(self) -> None:
        """Everything the engine would get wrong, refused at train() with the option named."""
        cls = type(self)
        sft = trl_sft.sft_trainer_base(self)
        own = sft or Trainer
        if cls.compute_loss is not own.compute_loss:
            raise GreedySnakeTrainerError(
                f"{cls.__name__} overrides compute_loss: greedysnake computes {own.__name__}'s own loss inside its "
                "engine (in the head layer, per micro-batch) and cannot run another; remove the override, or train "
                "with the \"greedysnake\" block off")
        if sft is not None:
            trl_sft.refuse_sft_options(self, GreedySnakeTrainerError)
        for method in _MIXIN_METHODS:
            if getattr(cls, method) is not getattr(GreedySnakeTrainerMixin, method):
                raise GreedySnakeTrainerError(
                    f"{cls.__name__} overrides {method} after GreedySnakeTrainerMixin: greedysnake needs its own "
                    f"(put GreedySnakeTrainerMixin first in the bases, or remove the override)")
        refused = {
            "compute_loss_func": self.compute_loss_func is not None,
            "label_smoothing_factor": self.label_smoother is not None,
            "compute_metrics": self.compute_metrics is not None,
            "preprocess_logits_for_metrics": self.preprocess_logits_for_metrics is not None,
            "neftune_noise_alpha": self.neftune_noise_alpha is not None,
            "torch_compile": bool(self.args.torch_compile),
            "parallelism_config": getattr(self.args, "parallelism_config", None) is not None,
        }
        for option, set_ in refused.items():
            if set_:
                raise GreedySnakeTrainerError(
                    f"{option} is set, which greedysnake does not support (its engine computes Trainer's default "
                    f"causal-LM loss and evaluates the loss only): unset {option}, or train with the block off")
        ds_config = self._ds_config()
        check_ds_config(ds_config, get_accelerator().device_name())
        if (ds_config.get("tensor_parallel") or {}).get("autotp_size", 1) > 1:
            raise GreedySnakeTrainerError("tensor_parallel.autotp_size > 1 is not supported by greedysnake: remove it")
        if "gradient_clipping" not in ds_config and self.args.max_grad_norm != default_gradient_clipping():
            raise GreedySnakeTrainerError(
                f"ds_config has no \"gradient_clipping\", so DeepSpeed clips at its default "
                f"{default_gradient_clipping()} while max_grad_norm is {self.args.max_grad_norm}: set "
                "\"gradient_clipping\": \"auto\" (Trainer fills in max_grad_norm)")

    # ------------------------------------------------------------------ training

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._greedysnake_engine() is not None:
            self._greedysnake_window = _Window(batch_samples, num_items_in_batch)
        return batch_samples, num_items_in_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not isinstance(model, GreedySnakeEngine):
            return super().training_step(model, inputs, num_items_in_batch)
        window = self._greedysnake_window
        if window is None or not window.is_next(inputs):
            raise RuntimeError("GreedySnakeTrainer.training_step got a micro-batch that is not the next one of the "
                               "window get_batch_samples fetched: greedysnake runs a whole accumulation window as one "
                               "step, so the training loop must be Trainer's own")
        if window.position == 0:
            window.loss_per_micro_batch = self._train_window(model, window)
        window.position += 1
        return window.loss_per_micro_batch

    def _train_window(self, engine: GreedySnakeEngine, window: _Window) -> torch.Tensor:
        """One engine step over the window; the window's loss divided by its number of micro-batches."""
        engine.train()
        micro_batches = [micro_batch(self._prepare_inputs(sample)) for sample in window.samples]
        count = len(micro_batches)
        self._greedysnake_loss.configure(self._loss_scaling(window.num_items_in_batch, count))
        self._greedysnake_step_lr = engine.optimizer.param_groups[0]["lr"]  # the rate this step uses
        loss = engine.train_batch(iter(micro_batches), num_micro_batches=count)
        self._record_micro_batch_metrics("train", engine, window.samples)
        return (loss / count).to(self.args.device)

    def _record_micro_batch_metrics(self, mode: str, engine: GreedySnakeEngine, samples) -> None:
        """What the trainer's compute_loss logs per micro-batch from the logits (SFTTrainer's metrics)."""
        if trl_sft.sft_trainer_base(self) is not None:
            trl_sft.record_metrics(self, mode, engine.last_micro_batch_metrics, samples)

    def _loss_scaling(self, num_items_in_batch, window_length: Optional[int]) -> LossScaling:
        """What Trainer.compute_loss and Trainer.training_step do to the model's loss, for the engine
        (``window_length``: the training window's micro-batches; None for an eval batch)."""
        passes_items = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        items = num_items_in_batch if passes_items else None
        # compute_loss: the token count is summed over ranks, so each rank's loss is scaled back up.
        multiplier = self.accelerator.num_processes if self.args.average_tokens_across_devices and passes_items else 1
        if window_length is None:
            return LossScaling(items, multiplier)
        scaled_for_ga = self.loss_is_scaled_for_ga if self.loss_is_scaled_for_ga is not None else passes_items
        # training_step divides a loss not scaled for the window by its length; the engine divides every
        # micro-batch's loss by it, so a scaled one is multiplied by it first.
        return LossScaling(items, multiplier * window_length if scaled_for_ga else multiplier)

    def floating_point_ops(self, inputs) -> int:
        # Trainer's count, with the parameters counted before the engine emptied the module's.
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if self._greedysnake_engine() is None or main_input not in inputs:
            return super().floating_point_ops(inputs)
        return 6 * inputs[main_input].numel() * self._greedysnake_flops_parameters

    def _get_learning_rate(self):
        # Plain Trainer logs the rate the step used (its scheduler steps after); the engine has stepped
        # its scheduler by the time Trainer asks.
        if self._greedysnake_engine() is not None and self._greedysnake_step_lr is not None:
            return self._greedysnake_step_lr
        return super()._get_learning_rate()

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, *args, **kwargs):
        if self.greedysnake_enabled():
            if self._greedysnake_engine() is None:
                raise GreedySnakeTrainerError("evaluate() runs through the greedysnake engine, which train() builds: "
                                              "call train() first (for evaluation alone, use the block off)")
            if self.compute_metrics is not None:
                raise GreedySnakeTrainerError("compute_metrics is set, but greedysnake evaluates the loss only: "
                                              "unset compute_metrics")
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        if self.greedysnake_enabled():
            raise GreedySnakeTrainerError("predict() needs logits, which greedysnake's engine does not return (it "
                                          "evaluates the loss only): use evaluate(), or save_model() and predict with "
                                          "the saved model")
        return super().predict(*args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        engine = self._greedysnake_engine()
        if engine is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        pair = micro_batch(inputs)
        # As Trainer.prediction_step: the batch's own token count (summed over ranks).
        num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        self._greedysnake_loss.configure(self._loss_scaling(num_items_in_batch, None))
        engine.eval_batch(iter([pair]), num_micro_batches=1)
        self._record_micro_batch_metrics("eval", engine, [inputs])
        return self._greedysnake_loss.last_value.mean().to(self.args.device), None, None


class GreedySnakeTrainer(GreedySnakeTrainerMixin, Trainer):
    """``transformers.Trainer`` that trains on the greedysnake engine when the DeepSpeed config's
    ``"greedysnake"`` block enables it, and is plain Trainer (under DeepSpeed) otherwise."""
