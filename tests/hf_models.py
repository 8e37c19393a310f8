"""Tiny random-init Hugging Face causal LMs (built from config objects, no downloads) for the tests."""
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ("gpt2", "llama", "opt", "gpt_neox")
VOCAB = 256
SEQ_LEN = 32


def tiny_config(family: str, hidden: int = 64, layers: int = 2, dropout: float = 0.0):
    import transformers
    common = dict(vocab_size=VOCAB, num_hidden_layers=layers, num_attention_heads=4, hidden_size=hidden,
                  max_position_embeddings=2 * SEQ_LEN, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_layer=layers, n_head=4, n_embd=hidden, n_positions=2 * SEQ_LEN,
                                       resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                       bos_token_id=0, eos_token_id=1)
    if family == "llama":
        return transformers.LlamaConfig(intermediate_size=2 * hidden, num_key_value_heads=2,
                                        attention_dropout=dropout, **common)
    if family == "opt":
        return transformers.OPTConfig(ffn_dim=2 * hidden, word_embed_proj_dim=hidden, dropout=dropout,
                                      attention_dropout=dropout, **common)
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(intermediate_size=2 * hidden, hidden_dropout=dropout,
                                          attention_dropout=dropout, **common)
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


def tiny_model(family: str, seed: int = 0, **options) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **options))
    return model.float()


def hf_data(seed: int = 0):
    """(input_ids, labels) micro-batches; HF's loss shifts the labels itself, so labels are the inputs."""
    from ds_greedysnake.models.gpt import micro_batches, synthetic_corpus
    from helpers import MICRO_BATCH_SIZE
    stream = micro_batches(synthetic_corpus(20000, VOCAB, seed), MICRO_BATCH_SIZE, SEQ_LEN, seed)
    return ((inputs, inputs) for inputs, _ in stream)


def hf_loss_of(model, inputs, labels):
    """The reference's loss: HF's own, from its labels."""
    return model(input_ids=inputs, labels=labels).loss


LORA_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "gpt2": ["c_attn", "c_proj", "c_fc"]}  # gpt2: Conv1D projections, tied (frozen) embeddings


def lora_model(family: str, rank: int = 4, seed: int = 0):
    """A tiny random-init HF model with PEFT LoRA adapters on its attention and MLP projections. PEFT starts
    lora_B at zero; here it starts random, so that every adapter weight has a gradient from step 1."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny_model(family, seed=seed),
                           LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                      target_modules=LORA_TARGETS[family], fan_in_fan_out=family == "gpt2"))
    torch.manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    return model


def tiny_tokenizer():
    """A word-level tokenizer for VOCAB ids, built in code (no download): <s> </s> <pad> <unk>, then the
    words w4 ... w255, split on whitespace; texts are words from ``random_text``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3}
    vocab.update({f"w{index}": index for index in range(4, VOCAB)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def random_text(generator: torch.Generator, words: int) -> str:
    """``words`` words drawn by a Zipf law over w4 ... w255: a few are frequent, so that a model learns to
    predict some within a few steps (a token accuracy above zero)."""
    weights = 1.0 / torch.arange(1, VOCAB - 3, dtype=torch.float64)
    drawn = torch.multinomial(weights, words, replacement=True, generator=generator) + 4
    return " ".join(f"w{int(index)}" for index in drawn)
