"""scripts/train_hf.py's job through Hugging Face's Trainer: GreedySnakeTrainer, with --baseline for
ZeRO-Infinity (the same script and config, the "greedysnake" block off). No downloads.

    deepspeed --num_gpus 1 scripts/train_hf_trainer.py --family llama --hidden 1024 --layers 8 --steps 5
    python scripts/train_hf_trainer.py --family gpt2 --hidden 256 --layers 4             # one process
    python scripts/train_hf_trainer.py --family llama --baseline                          # ZeRO-Infinity
    DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --num_gpus 2 scripts/train_hf_trainer.py    # two ranks on the CPU
    accelerate launch --use_deepspeed --deepspeed_config_file ds.json scripts/train_hf_trainer.py --config-from-launcher

It is an ordinary Trainer script written for ZeRO-Infinity (DeepSpeed config with "auto" values,
activation checkpointing on, the model made after TrainingArguments so that ZeRO-3 builds it under
zero.Init); the only greedysnake-specific line is the import of GreedySnakeTrainer, and the config's
"greedysnake" block. The model is built from a transformers config with random weights (or loaded from
--config-path when that folder holds weights); data: token ids saved with torch.save (--data) or a
generated corpus, cut into --seq-len blocks. --checkpoint-every N saves Trainer checkpoints (the engine's
checkpoint inside), --resume continues from one, --save-model writes a from_pretrained folder at the end.
The last line printed is a JSON report: per-step losses and grad norms, step time, peak resident memory.
"""
import argparse
import json
import os
import sys

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SCRIPTS)
sys.path.insert(0, os.path.dirname(SCRIPTS))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: configs are built here or read from disk

from train import use_nvme_path  # noqa: E402
from train_hf import add_model_arguments, largest_parameter, load_corpus, memory_snapshot, model_config  # noqa: E402  (sets RANK etc.)

import torch  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

from ds_greedysnake import GreedySnakeTrainer  # noqa: E402  (was: from transformers import Trainer)

REPO = os.path.dirname(SCRIPTS)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "greedysnake_hf_trainer.json"))
    parser.add_argument("--config-from-launcher", action="store_true",
                        help="accelerate launch passes the DeepSpeed config (--deepspeed_config_file)")
    parser.add_argument("--nvme-path", default=None, help="folder on an SSD (default: the config's, under the repo)")
    parser.add_argument("--steps", type=int, default=10, help="max_steps")
    parser.add_argument("--micro-batches", type=int, default=8, help="gradient_accumulation_steps (M)")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="per_device_train_batch_size")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--fp32", action="store_true",
                        help="fp32 instead of bf16 (on the CPU always: TrainingArguments refuses bf16 without a GPU)")
    parser.add_argument("--baseline", action="store_true", help="DeepSpeed's ZeRO-Infinity instead of greedysnake")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save a Trainer checkpoint every N steps")
    parser.add_argument("--output-dir", default=None, help="Trainer's output_dir (default: <nvme-path>/trainer_output)")
    parser.add_argument("--resume", default=None, help="a checkpoint folder, or 'latest' for the last in output_dir")
    parser.add_argument("--save-model", default=None, help="save_model() into this folder at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser.parse_args()


def deepspeed_config(args) -> dict:
    """The ZeRO-Infinity config with this run's SSD folder; the block on unless --baseline."""
    with open(args.config) as handle:
        config = json.load(handle)
    use_nvme_path(config, args.nvme_path)
    # ZeRO-Infinity's swap buffers must hold the largest parameter (counted on a meta-device copy).
    offload = config["zero_optimization"]["offload_param"]
    offload["buffer_size"] = max(offload.get("buffer_size", 0), largest_parameter(args))
    config.setdefault("greedysnake", {})["enabled"] = not args.baseline
    return config


class TokenBlocks(torch.utils.data.Dataset):
    """A token stream cut into seq_len blocks; the labels are the inputs (HF's loss shifts them)."""

    def __init__(self, corpus: torch.Tensor, seq_len: int):
        self.corpus, self.seq_len = corpus, seq_len

    def __len__(self):
        return self.corpus.numel() // self.seq_len

    def __getitem__(self, index):
        block = self.corpus[index * self.seq_len:(index + 1) * self.seq_len]
        return {"input_ids": block, "labels": block.clone()}


def training_data(args, vocab_size: int, num_blocks: int) -> TokenBlocks:
    return TokenBlocks(load_corpus(args, vocab_size, (num_blocks + 1) * args.seq_len), args.seq_len)


def build_model(args, bf16: bool):
    """Random init from the config, or the saved weights; made after TrainingArguments (zero.Init under ZeRO-3)."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if bf16 else torch.float32
    path = args.config_path
    if path and any(name.endswith((".safetensors", ".bin")) for name in os.listdir(path)):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    else:
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(model_config(args), dtype=dtype)
    model.config.use_cache = False
    return model


def main():
    args = parse_args()
    from transformers import TrainingArguments
    # With accelerate launch's --deepspeed_config_file, that file is the config (its nvme_path and block).
    config = None if args.config_from_launcher else deepspeed_config(args)
    output_dir = args.output_dir or (os.path.join(config["zero_optimization"]["offload_param"]["nvme_path"],
                                                  "trainer_output") if config else "trainer_output")
    world_size = int(os.environ["WORLD_SIZE"])
    # TrainingArguments refuses bf16 on the CPU unless use_cpu, which turns DeepSpeed off.
    bf16 = not args.fp32 and get_accelerator().device_name() != "cpu"
    training = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=args.micro_batches,
        learning_rate=args.lr, adam_beta2=0.95, weight_decay=args.weight_decay, max_grad_norm=1.0, bf16=bf16,
        lr_scheduler_type="cosine", warmup_steps=min(2, args.steps), logging_steps=1,
        save_strategy="steps" if args.checkpoint_every else "no", save_steps=args.checkpoint_every or 500,
        activation_checkpointing=True, seed=args.seed, report_to="none", dataloader_num_workers=0,
        deepspeed=config)
    model = build_model(args, bf16)
    num_blocks = args.steps * args.micro_batches * args.micro_batch_size * world_size
    trainer = GreedySnakeTrainer(model=model, args=training,
                                 train_dataset=training_data(args, model.config.vocab_size, num_blocks))
    resume = True if args.resume == "latest" else args.resume
    result = trainer.train(resume_from_checkpoint=resume)
    training_memory = memory_snapshot()
    if args.save_model:
        trainer.save_model(args.save_model)
    engine = trainer.model_wrapped
    if hasattr(engine, "close"):
        engine.close()
    if trainer.is_world_process_zero():
        steps = [entry for entry in trainer.state.log_history if "loss" in entry and "train_loss" not in entry]
        tokens = args.micro_batches * args.micro_batch_size * args.seq_len * world_size
        step_seconds = result.metrics["train_runtime"] / max(1, len(steps))
        greedysnake = type(engine).__name__ == "GreedySnakeEngine"
        print(json.dumps({"engine": "greedysnake" if greedysnake else "ZeRO-Infinity",
                          "engine_class": type(engine).__name__, "model": type(model).__name__,
                          "world_size": world_size, "steps": result.global_step,
                          "losses": [entry["loss"] for entry in steps],
                          "grad_norms": [entry.get("grad_norm") for entry in steps],
                          "learning_rates": [entry["learning_rate"] for entry in steps],
                          "train_loss": result.training_loss, "seconds_per_step": round(step_seconds, 2),
                          "tokens_per_second": round(tokens / step_seconds, 1),
                          "peak_rss_training": training_memory}), flush=True)


if __name__ == "__main__":
    main()
