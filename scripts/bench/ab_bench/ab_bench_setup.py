"""What both engines of the A/B benchmark share: the configurations, the one ds_config, the aio block,
and small process helpers. Used by ab_bench.py (the parent), ab_bench_child.py (one engine run or the
machine probe, in its own process) and ab_bench_report.py (roofline, table, plot)."""
import glob
import os
import resource
import shutil
import socket
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                   ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29523")):
    os.environ.setdefault(key, value)
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as scripts/env.sh does
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))

MIB = 2**20
ENGINES = ("zero_infinity", "greedysnake")
LABELS = {"zero_infinity": "ZeRO-Infinity", "greedysnake": "greedysnake"}

# Two regimes. ssd_bound: few tokens per micro-batch against many parameter bytes, so moving
# parameters and optimizer states (and, for ZeRO-Infinity, parameters again per micro-batch) dominates;
# 8 blocks, because a layer's update can only overlap the layers between its backward and its next
# forward (with 2 blocks, one block's whole update has nothing to hide behind; real LLMs have 24-96).
# compute_bound: a smaller model with many tokens per micro-batch.
# lora: ssd_bound's model with PEFT LoRA adapters (rank lora_rank) on every block matrix, the base frozen
# (the same PEFT injection under both engines): the SSD traffic is almost all base-weight reads.
CONFIGS = {
    "ssd_bound": dict(hidden=512, layers=8, heads=8, vocab=2048, seq_len=8, micro_batch_size=1),
    "compute_bound": dict(hidden=512, layers=2, heads=8, vocab=2048, seq_len=128, micro_batch_size=4),
    "lora": dict(hidden=512, layers=8, heads=8, vocab=2048, seq_len=8, micro_batch_size=1, lora_rank=8),
}
QUICK_CONFIGS = {
    "ssd_bound": dict(hidden=256, layers=4, heads=4, vocab=1024, seq_len=8, micro_batch_size=1),
    "compute_bound": dict(hidden=256, layers=2, heads=4, vocab=1024, seq_len=128, micro_batch_size=4),
    "lora": dict(hidden=256, layers=4, heads=4, vocab=1024, seq_len=8, micro_batch_size=1, lora_rank=4),
}
DEFAULT_CONFIGS = ("ssd_bound", "compute_bound")  # what a run without --configs measures
LORA_TARGETS = ["qkv", "proj", "up", "down"]  # the built-in GPT's block matrices (ds_greedysnake/models/gpt.py)
# The same aio block for both engines (and for the roofline's SSD rates).
AIO = {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}


def ds_config(nvme_path: str, micro_batch_size: int, num_micro_batches: int, enabled: bool,
              largest_param_numel: int) -> dict:
    """One ds_config for both engines; greedysnake ignores the ZeRO-Infinity-only knobs."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": num_micro_batches,
        # Explicit: DeepSpeed 0.19.8 clips at 1.0 when the key is absent.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            # Each needed for ZeRO-Infinity to run (or to be correct) on DeepSpeed 0.19.8: docs/zero_infinity.md.
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": 100000,  # DeepSpeed's default, stated
            "sub_group_size": 1,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0, "pin_memory": False,
                              "buffer_count": 5, "buffer_size": largest_param_numel},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False},
        },
        "aio": dict(AIO),
        "greedysnake": {"enabled": enabled},
    }


def gpt_config(model: dict):
    from ds_greedysnake.models.gpt import GPTConfig
    return GPTConfig(vocab_size=model["vocab"], seq_len=model["seq_len"], hidden=model["hidden"],
                     num_heads=model["heads"], num_layers=model["layers"])


def add_lora(model, model_spec: dict):
    """PEFT LoRA adapters of rank ``lora_rank`` injected into every block matrix, everything else frozen (the
    model itself when the configuration has none). Under zero.Init the adapters are partitioned as created."""
    if not model_spec.get("lora_rank"):
        return model
    from peft import LoraConfig, inject_adapter_in_model
    rank = model_spec["lora_rank"]
    return inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                              target_modules=LORA_TARGETS), model)


def largest_param_numel(model: dict) -> int:
    hidden, vocab = model["hidden"], model["vocab"]
    return max(4 * hidden * hidden + 4 * hidden, vocab * hidden, 3 * hidden * hidden + 3 * hidden)


def parameter_count(model: dict) -> int:
    h, v, s, n = model["hidden"], model["vocab"], model["seq_len"], model["layers"]
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    return v * h + s * h + n * block + 2 * h + v * h


def process_io() -> dict:
    try:
        with open("/proc/self/io") as handle:
            fields = dict(line.split(": ") for line in handle.read().splitlines())
        return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"])}
    except OSError:
        return {"read_bytes": 0, "write_bytes": 0}


def peak_rss_mib(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux reports KiB


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def remove_shm_buffers(port: str) -> None:
    """DeepSpeed's CPU comm op leaves /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.remove(path)
        except OSError:
            pass


