"""One TRL SFTTrainer run for tests/e2e/test_sft_trainer.py: plain SFTTrainer without DeepSpeed, or
GreedySnakeSFTTrainer on greedysnake, as a user's script would write them (SFTConfig's own defaults
but for the few set below; gradient_checkpointing stays on, as SFTConfig defaults it).

The data are texts of random words of varied lengths (tests/hf_models.py's word-level tokenizer, saved
with the tiny model): a language-modeling dataset ({"text"}), or with ``--completion-only`` a
prompt-completion one ({"prompt", "completion"}), which SFTTrainer trains on the completions only.
Started directly (one rank) or by ``deepspeed --num_gpus N``. Rank 0 writes to ``--out``: the log
history, the eval metrics, the trained fp32 weights and the engine's class.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402

BATCH, MAX_LENGTH = 2, 32


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("plain", "greedysnake"), required=True)
    parser.add_argument("--model", required=True, help="a saved tiny model with its tokenizer")
    parser.add_argument("--nvme", help="nvme_path of the DeepSpeed config")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--out", required=True, help="where rank 0 writes the results (torch.save)")
    parser.add_argument("--gas", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--steps", type=int, default=4, help="max_steps")
    parser.add_argument("--samples", type=int, default=48, help="training texts (before packing)")
    parser.add_argument("--no-packing", action="store_true", help="packing=False: padded batches")
    parser.add_argument("--completion-only", action="store_true", help="a prompt-completion dataset")
    parser.add_argument("--lora", action="store_true", help="peft_config=LoraConfig(...) passed to SFTTrainer")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser.parse_args()


def ds_config(nvme_path: str) -> dict:
    """ZeRO-Infinity written the Hugging Face way (Trainer fills in every "auto"), greedysnake enabled."""
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "steps_per_print": 1000000,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto"}},
        "zero_optimization": {
            "stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
        },
        "greedysnake": {"enabled": True},
    }


def datasets(completion_only: bool, samples: int = 48):
    """(train, eval): texts of 3 to 24 words (packing joins short ones), seeded."""
    from datasets import Dataset
    from hf_models import random_text
    generator = torch.Generator().manual_seed(0)

    def words() -> int:
        return int(torch.randint(3, 25, (1,), generator=generator))

    def rows(count: int):
        if completion_only:
            return {"prompt": [random_text(generator, words()) for _ in range(count)],
                    "completion": [" " + random_text(generator, words()) for _ in range(count)]}
        return {"text": [random_text(generator, words()) for _ in range(count)]}

    return Dataset.from_dict(rows(samples)), Dataset.from_dict(rows(6))


def sft_config(args, deepspeed_config):
    from trl import SFTConfig
    return SFTConfig(
        output_dir=args.output_dir, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=args.gas, max_steps=args.steps, max_length=MAX_LENGTH,
        packing=not args.no_packing, bf16=False, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1,
        max_grad_norm=1.0, weight_decay=0.0, logging_steps=1, save_strategy="no", seed=0, report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, deepspeed=deepspeed_config)


def lora_config():
    from peft import LoraConfig
    from hf_models import LORA_TARGETS
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS["llama"])


def final_weights(trainer, mode: str) -> dict:
    if mode == "greedysnake":
        return trainer.model_wrapped.master_parameters()
    return {name: param.detach().clone() for name, param in trainer.model.named_parameters()}


def main():
    args = parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    rank = int(os.environ["RANK"])
    from trl import SFTTrainer
    from ds_greedysnake import GreedySnakeSFTTrainer
    config = sft_config(args, None if args.mode == "plain" else ds_config(args.nvme))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train, evaluation = datasets(args.completion_only, args.samples)
    trainer_class = SFTTrainer if args.mode == "plain" else GreedySnakeSFTTrainer
    torch.manual_seed(0)  # PEFT's adapter initialisation
    trainer = trainer_class(model=model, args=config, train_dataset=train, eval_dataset=evaluation,
                            processing_class=tokenizer, peft_config=lora_config() if args.lora else None)
    train_output = trainer.train()
    eval_metrics = trainer.evaluate()
    weights = final_weights(trainer, args.mode)
    if rank == 0:
        torch.save({"log_history": trainer.state.log_history, "train_loss": train_output.training_loss,
                    "global_step": train_output.global_step, "eval": eval_metrics, "weights": weights,
                    "engine": type(trainer.model_wrapped).__name__, "world_size": int(os.environ["WORLD_SIZE"])},
                   args.out)
    if hasattr(trainer.model_wrapped, "close"):
        trainer.model_wrapped.close()


if __name__ == "__main__":
    main()
