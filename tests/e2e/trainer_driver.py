"""One Hugging Face Trainer run for tests/e2e/test_hf_trainer.py: plain Trainer without DeepSpeed,
GreedySnakeTrainer on greedysnake, or GreedySnakeTrainer with the block off (ZeRO-Infinity).

Started directly (one rank; RANK etc. default to a one-process job), by ``deepspeed --num_gpus N`` or by
``accelerate launch`` (``--config-from-launcher``: the DeepSpeed config comes from the launcher's
``--deepspeed_config_file``, written with ``--write-config``). The data: fixed random token ids with
about a third of the labels -100, batch 2. Rank 0 writes to ``--out``: Trainer's log history, train
loss, eval loss, the engine's class and the trained fp32 weights.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402

VOCAB, SEQ_LEN, BATCH = 256, 32, 2


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("plain", "greedysnake", "zero_infinity"), required=True)
    parser.add_argument("--model", help="a saved tiny model (save_pretrained)")
    parser.add_argument("--nvme", help="nvme_path of the DeepSpeed config")
    parser.add_argument("--output-dir", help="Trainer's output_dir")
    parser.add_argument("--out", help="where rank 0 writes the results (torch.save)")
    parser.add_argument("--gas", type=int, default=3, help="gradient_accumulation_steps")
    parser.add_argument("--samples", type=int, default=16, help="training samples (an epoch)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--save-total-limit", type=int, default=None)
    parser.add_argument("--resume", default=None, help="resume_from_checkpoint")
    parser.add_argument("--save-model", default=None, help="trainer.save_model() into this folder")
    parser.add_argument("--no-gather", action="store_true", help="stage3_gather_16bit_weights_on_model_save false: "
                        "Trainer's checkpoints hold the engine's checkpoint only")
    parser.add_argument("--save-pretrained", default=None, help="engine.save_pretrained(dir, dtype=float32) at the end")
    parser.add_argument("--scheduler-warnings-are-errors", action="store_true", help="torch's lr scheduler check "
                        "(lr_scheduler.step() before optimizer.step(), optimizer.step() overridden) raises")
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA adapters (rank 4, attention and MLP), the base "
                        "frozen")
    parser.add_argument("--config-from-launcher", action="store_true", help="accelerate launch passes the config")
    parser.add_argument("--write-config", default=None, help="only write the DeepSpeed config here")
    parser.add_argument("--refusals", action="store_true", help="record what train() refuses, then stop")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser.parse_args()


def ds_config(nvme_path: str, enabled: bool) -> dict:
    """A ZeRO-Infinity config written the Hugging Face way: Trainer fills in every "auto". No
    train_batch_size: on the CPU, TrainingArguments fills its "auto" before it knows the number of ranks."""
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "steps_per_print": 1000000,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto"}},
        # As tests/helpers.py: the stage3_* knobs keep ZeRO-Infinity exact on DeepSpeed 0.19.8.
        "zero_optimization": {
            "stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0, "sub_group_size": 1,
            "stage3_gather_16bit_weights_on_model_save": True,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0, "buffer_count": 5,
                              "buffer_size": 1 << 20},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
        },
        "greedysnake": {"enabled": enabled},
    }


def dataset(num_samples: int, seed: int):
    """Random token ids; about a third of the labels (a different count per sample) are -100."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (num_samples, SEQ_LEN), generator=generator)
    labels = input_ids.clone()
    labels[torch.rand(input_ids.shape, generator=generator) < 0.35] = -100
    return [{"input_ids": input_ids[i], "labels": labels[i]} for i in range(num_samples)]


def training_arguments(args, deepspeed_config):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=args.gas, learning_rate=1e-3, weight_decay=0.0, lr_scheduler_type="linear",
        warmup_steps=2, max_grad_norm=1.0, num_train_epochs=args.epochs, logging_steps=1,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit, seed=0, report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, deepspeed=deepspeed_config)


def final_weights(trainer, mode: str) -> dict:
    """The trained fp32 weights by name (every rank takes part in the gathers)."""
    if mode == "greedysnake":
        return trainer.model_wrapped.master_parameters()
    params = dict(trainer.model.named_parameters())
    if mode == "zero_infinity":
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: param.detach().clone() for name, param in params.items()}
    return {name: param.detach().clone() for name, param in params.items()}


def refusals(args) -> dict:
    """What GreedySnakeTrainer.train() says for settings it cannot train, each before any step."""
    from transformers import AutoModelForCausalLM, Trainer
    from ds_greedysnake import GreedySnakeTrainer

    class CustomLoss(GreedySnakeTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            return Trainer.compute_loss(self, model, inputs, **kwargs)

    typed = dataset(args.samples, 0)  # an input the model's split does not read (BERT-style segment ids)
    for sample in typed:
        sample["token_type_ids"] = torch.zeros(SEQ_LEN, dtype=torch.long)
    cases = {"compute_loss": (CustomLoss, {}, dataset(args.samples, 0)),
             "label_smoothing_factor": (GreedySnakeTrainer, {"label_smoothing_factor": 0.1}, dataset(args.samples, 0)),
             "token_type_ids": (GreedySnakeTrainer, {"remove_unused_columns": False}, typed)}
    messages = {}
    for name, (trainer_class, overrides, data) in cases.items():
        training = training_arguments(args, ds_config(args.nvme, True))
        for key, value in overrides.items():
            setattr(training, key, value)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        trainer = trainer_class(model=model, args=training, train_dataset=data)
        try:
            trainer.train()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
        engine = trainer.model_wrapped
        messages[name + ".steps"] = getattr(engine, "global_steps", None)
        if hasattr(engine, "close"):
            engine.close()
    return messages


def main():
    args = parse_args()
    deepspeed_config = None if args.mode == "plain" else ds_config(args.nvme, args.mode == "greedysnake")
    if args.no_gather and deepspeed_config is not None:
        deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    if args.scheduler_warnings_are_errors:
        import warnings
        warnings.filterwarnings("error", message=r"(Detected call of `lr_scheduler\.step\(\)`|Seems like "
                                r"`optimizer\.step\(\)` has been overridden)")
    if args.write_config:
        with open(args.write_config, "w") as handle:
            json.dump(deepspeed_config, handle)
        return
    from transformers import AutoModelForCausalLM, Trainer
    from ds_greedysnake import GreedySnakeTrainer
    rank = int(os.environ["RANK"])
    if args.refusals:
        result = refusals(args)
        if rank == 0:
            torch.save(result, args.out)
        return
    training = training_arguments(args, None if args.config_from_launcher else deepspeed_config)
    # Made after TrainingArguments, as the HF docs say: under ZeRO-3 the weights load into zero.Init partitions.
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False
    if args.lora:
        from peft import LoraConfig, get_peft_model
        from hf_models import LORA_TARGETS
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS["llama"]))
    # The ZeRO-Infinity baseline is GreedySnakeTrainer with the block off: one script does the A/B.
    trainer_class = Trainer if args.mode == "plain" else GreedySnakeTrainer
    trainer = trainer_class(model=model, args=training, train_dataset=dataset(args.samples, 0),
                            eval_dataset=dataset(4, 1))
    train_output = trainer.train(resume_from_checkpoint=args.resume)
    eval_loss = trainer.evaluate()["eval_loss"]
    weights = final_weights(trainer, args.mode)
    if args.save_model:
        trainer.save_model(args.save_model)
    if args.save_pretrained:
        trainer.model_wrapped.save_pretrained(args.save_pretrained, dtype=torch.float32)
    if rank == 0:
        torch.save({"log_history": trainer.state.log_history, "train_loss": train_output.training_loss,
                    "global_step": train_output.global_step, "eval_loss": eval_loss, "weights": weights,
                    "engine": type(trainer.model_wrapped).__name__, "world_size": int(os.environ["WORLD_SIZE"])},
                   args.out)
    if hasattr(trainer.model_wrapped, "close"):
        trainer.model_wrapped.close()


if __name__ == "__main__":
    main()
