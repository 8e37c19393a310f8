"""Shared pieces of the end-to-end tests: a tiny GPT, its ds_config, and the plain PyTorch reference."""
import copy
import glob
import os
import socket
from typing import Dict, List, Tuple

import torch

from ds_greedysnake.models.gpt import GPTConfig, build_gpt, lm_loss, micro_batches, synthetic_corpus

MICRO_BATCH_SIZE = 2


def tiny_gpt_config(hidden: int = 320) -> GPTConfig:
    # hidden 320: the block weights (qkv 1.2 MiB, up/down 1.6 MiB in fp32) exceed ZeRO-3's 1 MiB
    # swap threshold, and 320 is not a multiple of 128, the size at which ZeRO-Infinity 0.19.8 reads stale gradients.
    return GPTConfig(vocab_size=512, seq_len=32, hidden=hidden, num_heads=4, num_layers=3)


def ds_config(nvme_path: str, num_micro_batches: int, enabled: bool = True, clipping: float = 0.0,
              bf16: bool = False, greedysnake: Dict = None, scheduler: Dict = None) -> Dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "gradient_accumulation_steps": num_micro_batches,
        # Set explicitly: DeepSpeed 0.19.8 clips at 1.0 when the key is absent.
        "gradient_clipping": clipping,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
        # The stage3_* knobs and sub_group_size only matter to ZeRO-Infinity (the baseline on the same
        # config); each is needed for it to run correctly on DeepSpeed 0.19.8, see docs/zero_infinity.md.
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
            "sub_group_size": 1,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0,
                              "buffer_count": 5, "buffer_size": 1 << 20},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
        },
        "greedysnake": dict({"enabled": enabled}, **(greedysnake or {})),
        "steps_per_print": 1000,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    if scheduler:
        config["scheduler"] = scheduler
    return config


def data(config: GPTConfig, seed: int = 0):
    return micro_batches(synthetic_corpus(20000, config.vocab_size, seed), MICRO_BATCH_SIZE, config.seq_len, seed)


def reference_training(model: torch.nn.Module, config: GPTConfig, num_micro_batches: int, steps: int,
                       clipping: float = 0.0, batches=None, loss_of=None) -> Tuple[torch.nn.Module, List[float]]:
    """Plain PyTorch AdamW with gradient accumulation: the ground truth. ``batches`` (default: the tiny
    GPT's data) and ``loss_of(model, inputs, labels)`` (default: lm_loss of the output) serve other models."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    batches = batches if batches is not None else data(config)
    loss_of = loss_of or (lambda module, inputs, labels: lm_loss(module(inputs), labels))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        total = accumulate_micro_batches(model, batches, num_micro_batches, loss_of)
        if clipping > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
        optimizer.step()
        losses.append(total)
    return model, losses


def accumulate_micro_batches(model, batches, num_micro_batches: int, loss_of, after_backward=None) -> float:
    """One step's backward over ``num_micro_batches`` from ``batches`` (loss / M each, as DeepSpeed and the
    engine do); ``after_backward()`` runs after each. Returns the mean loss."""
    total = 0.0
    for _ in range(num_micro_batches):
        inputs, labels = next(batches)
        loss = loss_of(model, inputs, labels)
        (loss / num_micro_batches).backward()
        total += float(loss.detach()) / num_micro_batches
        if after_backward is not None:
            after_backward()
    return total


def relative_l2(got: Dict[str, torch.Tensor], reference: torch.nn.Module) -> float:
    numerator = denominator = 0.0
    for name, param in reference.named_parameters():
        numerator += float(((got[name].float() - param.detach().float()) ** 2).sum())
        denominator += float((param.detach().float() ** 2).sum())
    return (numerator / denominator) ** 0.5


def fresh_model(config: GPTConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_gpt(config)


def free_port() -> str:
    """A free TCP port for a child DeepSpeed process (remove_shm_buffers cleans up after it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def remove_shm_buffers(port: str) -> None:
    """DeepSpeed's CPU comm op leaves /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    (69 MB each); a child killed by a signal cannot remove its own."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.remove(path)
        except OSError:
            pass


def run_job(name: str, command, env: Dict[str, str], port: str, timeout: float = 900):
    """Run a child job (a driver script, alone or under a launcher) that uses ``port``; fail the test with the
    end of its output unless it exits 0. DeepSpeed's shm buffers for the port are removed either way."""
    import subprocess
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        remove_shm_buffers(port)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def leave_lock_of_a_dead_build(build_folder) -> str:
    """A torch-extensions build lock as a build killed mid-way leaves it (torch's FileBaton: created
    with O_EXCL, held open until the build ends): made by a process that is gone, an hour ago."""
    import subprocess
    import sys
    import time
    os.makedirs(build_folder, exist_ok=True)
    path = os.path.join(str(build_folder), "lock")
    subprocess.run([sys.executable, "-c", "import os, sys; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)", path],
                   check=True)
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))
    return path


def recorded_io(trace, process):
    """A record's issues, waits and messages of ``process``, in the form of the replay's log without its times
    (io_replay.ReplayResult.log): what the replay must have done, in order."""
    out = []
    for event in trace.of(process):
        if event.kind == "issue":
            out.append(("issue", event.store, event.handles[0], event.op, event.path, event.bytes))
        elif event.kind == "wait":
            out.append(("wait", event.store, event.handles))
        elif event.kind in ("send", "recv"):
            out.append((event.kind, event.op, event.serial))
    return out
