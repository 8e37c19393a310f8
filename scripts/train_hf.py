"""Train a Hugging Face causal LM with greedysnake (or ZeRO-Infinity with --baseline), no downloads.

    deepspeed --num_gpus 1 scripts/train_hf.py --family llama --hidden 1024 --layers 8 --steps 5
    python scripts/train_hf.py --family gpt2 --hidden 256 --layers 4          # one process, no launcher
    python scripts/train_hf.py --config-path saved_model_dir                   # a saved config (and weights)
    python scripts/train_hf.py --config-path saved_model_dir --save-pretrained out_dir   # trained weights out
    python scripts/train_hf.py --family llama --baseline                       # DeepSpeed's ZeRO-Infinity

The model is built from a transformers config with random weights, or starts from the safetensors
weights in --config-path: greedysnake reads them one layer at a time straight into its SSD regions
(ds_greedysnake.models.pretrained; the model never has to fit in host memory). --save-pretrained writes the
trained model as a Hugging Face checkpoint, one layer in memory at a time. Data: a 1-D tensor of
token ids saved with torch.save (--data), or a generated corpus. A tqdm bar shows loss, tokens/s and SSD GB/s (greedysnake: bytes counted at its aio
layer; --baseline: the process's /proc I/O counters). --checkpoint-every N saves with the engine's
save_checkpoint. At the end one JSON line reports peak resident memory (of the set-up and of the
training steps, this process and its optimizer worker) and step times.
"""
import argparse
import json
import os
import statistics
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SCRIPTS)
sys.path.insert(0, os.path.dirname(SCRIPTS))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: configs are built here or read from disk

from train import build_config, distributed_micro_batches, process_io_bytes  # noqa: E402  (also sets RANK etc.)

import torch  # noqa: E402
import deepspeed  # noqa: E402
from tqdm import tqdm  # noqa: E402

import ds_greedysnake  # noqa: E402
from ds_greedysnake.models.gpt import micro_batches, synthetic_corpus  # noqa: E402
from ds_greedysnake.models.hf import hf_causal_lm_loss  # noqa: E402

FAMILIES = ("gpt2", "llama", "opt", "gpt_neox")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and data options this script shares with train_hf_trainer.py."""
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--config-path", default=None, help="a local folder with config.json (and weights)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="llama: grouped-query heads (default: --heads)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 4x hidden; llama 8/3x)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--untie", action="store_true", help="separate input and output embeddings")
    parser.add_argument("--data", default=None, help="token ids saved with torch.save (1-D); default: generated")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--config", default=os.path.join(os.path.dirname(SCRIPTS), "configs", "greedysnake_hf.json"))
    parser.add_argument("--nvme-path", default=None, help="folder on an SSD (default: the config's, under the repo)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batches", type=int, default=None, help="gradient_accumulation_steps (M)")
    parser.add_argument("--bf16", action="store_true", help="bf16 even if the config has it off")
    parser.add_argument("--fp32", action="store_true", help="fp32 even if the config has bf16 on")
    parser.add_argument("--baseline", action="store_true", help="DeepSpeed's ZeRO-Infinity instead of greedysnake")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    parser.add_argument("--checkpoint-dir", default=None, help="default: <nvme-path>/checkpoints")
    parser.add_argument("--save-pretrained", default=None, help="after training, write the model here as a "
                        "Hugging Face checkpoint (safetensors shards + config)")
    parser.add_argument("--lora", type=int, default=None, metavar="R",
                        help="fine-tune PEFT LoRA adapters of rank R, the base frozen (--save-pretrained then writes "
                             "the adapters, as PEFT does)")
    parser.add_argument("--lora-targets", nargs="+", default=["all-linear"],
                        help="modules that get adapters (PEFT's target_modules; default: every Linear but the head)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser.parse_args()


def model_config(args):
    import transformers
    if args.config_path:
        return transformers.AutoConfig.from_pretrained(args.config_path, local_files_only=True)
    heads, hidden, layers, vocab = args.heads, args.hidden, args.layers, args.vocab
    positions = max(args.seq_len, 2048)
    if args.family == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_layer=layers, n_head=heads, n_embd=hidden, n_positions=positions,
                                       n_inner=args.intermediate, resid_pdrop=args.dropout, embd_pdrop=args.dropout,
                                       attn_pdrop=args.dropout, tie_word_embeddings=not args.untie,
                                       bos_token_id=min(50256, vocab - 1), eos_token_id=min(50256, vocab - 1))
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  max_position_embeddings=positions, tie_word_embeddings=args.family == "opt" and not args.untie)
    if args.family == "llama":
        intermediate = args.intermediate or 256 * ((8 * hidden // 3 + 255) // 256)
        return transformers.LlamaConfig(intermediate_size=intermediate, num_key_value_heads=args.kv_heads or heads,
                                        attention_dropout=args.dropout, **common)
    if args.family == "opt":
        return transformers.OPTConfig(ffn_dim=args.intermediate or 4 * hidden, word_embed_proj_dim=hidden,
                                      dropout=args.dropout, attention_dropout=args.dropout, **common)
    return transformers.GPTNeoXConfig(intermediate_size=args.intermediate or 4 * hidden, hidden_dropout=args.dropout,
                                      attention_dropout=args.dropout, **common)


def pretrained_folder(args):
    """--config-path when it holds safetensors weights greedysnake can stream in, else None."""
    if args.baseline or not args.config_path:
        return None
    return args.config_path if any(name.endswith(".safetensors") for name in os.listdir(args.config_path)) else None


def build_model(args, ds_config):
    """Random init from the config (or the saved weights), in the compute dtype, in train mode."""
    from transformers import AutoModelForCausalLM
    config = model_config(args)
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    if pretrained_folder(args):
        # Parameters on the meta device: initialize(pretrained=...) reads the weights layer by layer.
        from ds_greedysnake.models.pretrained import empty_model
        model = empty_model(config, dtype)
        model.config.use_cache = False
        return with_lora(args, model)
    has_weights = args.config_path and any(name.endswith((".safetensors", ".bin")) for name in os.listdir(args.config_path))
    torch.manual_seed(args.seed)

    def make():
        if has_weights:
            return AutoModelForCausalLM.from_pretrained(args.config_path, local_files_only=True, dtype=dtype)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)

    if args.baseline and dtype == torch.float32:
        # fp32 under ZeRO-3 needs the model built under zero.Init (else it gets bf16 weights on CPU). Import
        # the model's code first: zero.Init patches torch.Tensor.__new__, and torch._dynamo (which transformers
        # imports lazily) refuses to load under that patch. Note: HF's own weight init does not reach
        # parameters zero.Init has already partitioned, so this model starts from PyTorch's default init.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = make()
    else:
        model = make()  # the same initial weights for both engines
    if args.baseline and args.lora is None:
        # The fair baseline recomputes activations as greedysnake does. Not under LoRA: ZeRO-Infinity
        # 0.19.8 fails with checkpointing over a frozen base ("Not enough buffers 0 for swapping 1").
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return with_lora(args, model).train()


def with_lora(args, model):
    """The model with PEFT LoRA adapters of rank --lora (the base frozen), or the model itself."""
    if args.lora is None:
        return model
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(args.seed)
    return get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                            target_modules=args.lora_targets[0] if args.lora_targets == ["all-linear"]
                                            else args.lora_targets))


def largest_parameter(args) -> int:
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(model_config(args))
    return max(p.numel() for p in twin.parameters())


def load_corpus(args, vocab_size: int, min_tokens: int) -> torch.Tensor:
    """The token ids of --data (checked against the vocabulary), or a generated corpus of at least
    ``min_tokens``."""
    if args.data:
        corpus = torch.load(args.data).reshape(-1).long()
        if int(corpus.max()) >= vocab_size:
            raise ValueError(f"--data {args.data} has token id {int(corpus.max())} >= the model's vocab_size "
                             f"{vocab_size}: tokenize with the model's tokenizer or raise --vocab")
        return corpus
    return synthetic_corpus(max(200_000, min_tokens), vocab_size, args.seed)


def token_stream(args, vocab_size: int, micro_batch_size: int):
    """Endless (input_ids, labels) micro-batches; HF's loss shifts the labels, so labels are the inputs."""
    corpus = load_corpus(args, vocab_size, 4 * args.seq_len)
    for inputs, _ in micro_batches(corpus, micro_batch_size, args.seq_len, args.seed):
        yield inputs, inputs


# ---------------------------------------------------------------- memory: this process and its children

def _children() -> list:
    mine = str(os.getpid())
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if handle.read().rsplit(")", 1)[1].split()[1] == mine:
                        pids.append(entry)
            except (OSError, IndexError):
                pass
    return pids


def peak_rss_gib(pid: str = "self") -> float:
    """VmHWM: the resident-set high-water mark since start or since reset_peak_rss()."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def reset_peak_rss(pid: str = "self") -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")  # Linux: reset the high-water mark to the current RSS
    except OSError:
        pass


def memory_snapshot() -> dict:
    return {"process_gib": round(peak_rss_gib(), 3),
            "children_gib": {pid: round(peak_rss_gib(pid), 3) for pid in _children()}}


def main():
    args = parse_args()
    if args.save_pretrained and args.baseline:
        raise SystemExit("--save-pretrained writes greedysnake's weights; with --baseline use DeepSpeed's "
                         "save_16bit_model (stage3_gather_16bit_weights_on_model_save) instead")
    config = build_config(args)
    if args.fp32:
        config.pop("bf16", None)
    offload = config["zero_optimization"]["offload_param"]
    # ZeRO-Infinity's swap buffers must hold the largest parameter (counted on a meta-device copy).
    offload["buffer_size"] = max(offload.get("buffer_size", 0), largest_parameter(args))
    model = build_model(args, config)
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    engine, _, _, _ = ds_greedysnake.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                loss_fn=hf_causal_lm_loss, pretrained=pretrained_folder(args))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    micro_batch_size, num_micro_batches = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    setup_memory = memory_snapshot()
    engine_name = "ZeRO-Infinity" if args.baseline else "greedysnake"
    if rank == 0:
        lora = f" (LoRA rank {args.lora}: {trainable / 1e6:.2f}M trainable)" if args.lora is not None else ""
        print(f"{engine_name}: {type(model).__name__} {parameters / 1e6:.1f}M parameters{lora}, M={num_micro_batches} x "
              f"{micro_batch_size} x {args.seq_len} tokens per rank, {world_size} rank(s), "
              f"{'bf16' if 'bf16' in config else 'fp32'}, SSD folder {offload['nvme_path']}", flush=True)
    batches = distributed_micro_batches(token_stream(args, model.config.vocab_size, micro_batch_size), rank, world_size)
    tokens_per_step = world_size * num_micro_batches * micro_batch_size * args.seq_len
    checkpoint_dir = args.checkpoint_dir or os.path.join(offload["nvme_path"], "checkpoints")
    for pid in ["self"] + _children():
        reset_peak_rss(pid)
    step_seconds, losses = [], []
    bar = tqdm(range(1, args.steps + 1), disable=rank != 0, desc=engine_name, dynamic_ncols=True)
    for step in bar:
        io_before = process_io_bytes()
        started = time.perf_counter()
        loss = float(engine.train_batch(batches))
        seconds = time.perf_counter() - started
        step_seconds.append(seconds)
        losses.append(loss)
        metrics = getattr(engine, "last_step_metrics", None)
        if metrics is not None:
            ssd_bytes = sum(metrics.ssd_bytes_read.values()) + sum(metrics.ssd_bytes_written.values())
        else:
            io_after = process_io_bytes()
            ssd_bytes = (io_after[0] - io_before[0]) + (io_after[1] - io_before[1])
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / seconds:.0f}",
                        ssd_GBs=f"{ssd_bytes / seconds / 1e9:.2f}", step_s=f"{seconds:.1f}")
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            engine.save_checkpoint(checkpoint_dir, tag=f"step{step}")
    training_memory = memory_snapshot()
    if args.save_pretrained:
        getattr(engine.module, "get_base_model", lambda: engine.module)().config.use_cache = True  # on for generation
        engine.save_pretrained(args.save_pretrained)
        if rank == 0:
            print(f"saved the trained model to {args.save_pretrained}", flush=True)
    if hasattr(engine, "close"):
        engine.close()
    if rank == 0:
        print(json.dumps({"engine": engine_name, "model": type(model).__name__, "parameters": parameters,
                          "trainable_parameters": trainable, "lora_rank": args.lora,
                          "steps": args.steps, "losses": losses, "step_seconds": [round(s, 2) for s in step_seconds],
                          "median_step_seconds_after_first": round(statistics.median(step_seconds[1:] or step_seconds), 2),
                          "peak_rss_setup": setup_memory, "peak_rss_training": training_memory}), flush=True)


if __name__ == "__main__":
    main()
