"""Checkpoints: exact resume in a new process, survival of a kill at any point of a save, a full disk;
a foreign pickle refused, resume on another number of ranks, a damaged shard named with nothing loaded,
the last checkpoints kept."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import free_port, remove_shm_buffers

pytestmark = pytest.mark.slow

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_driver.py")


def drive(tmp_path, mode, steps, out_name, kill_at=None, expect_killed=False):
    command = [sys.executable, DRIVER, mode, "--nvme", str(tmp_path / "nvme"), "--checkpoints",
               str(tmp_path / "checkpoints"), "--out", str(tmp_path / out_name), "--steps", str(steps)]
    if kill_at:
        command += ["--kill-at", kill_at]
    port = free_port()
    try:
        finished = subprocess.run(command, env=dict(os.environ, MASTER_PORT=port), capture_output=True, text=True,
                                  timeout=600)
    finally:
        remove_shm_buffers(port)
    if expect_killed:
        assert finished.returncode == -9, finished.stderr[-3000:]
    else:
        assert finished.returncode == 0, finished.stderr[-3000:]
    return torch.load(str(tmp_path / out_name))


def assert_same_masters(first, second):
    assert first.keys() == second.keys()
    for index in first:
        assert torch.equal(first[index], second[index]), f"layer {index}"


def test_resume_in_a_new_process_is_exact(tmp_path):
    straight = drive(tmp_path / "a", "straight", 4, "straight.pt")
    first_half = drive(tmp_path / "b", "save", 2, "first.pt")
    second_half = drive(tmp_path / "b", "resume", 2, "second.pt")
    assert first_half["losses"] + second_half["losses"] == straight["losses"]
    assert second_half["global_steps"] == straight["global_steps"] == 4
    assert second_half["step_count"] == 4 and second_half["lr"] == straight["lr"]
    assert_same_masters(second_half["masters"], straight["masters"])


@pytest.mark.parametrize("kill_at", ["layer:0", "layer:3", "state", "published"])
def test_a_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, kill_at):
    saved = drive(tmp_path, "save", 2, "saved.pt", kill_at=kill_at, expect_killed=True)
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step2"
    if kill_at != "published":
        assert not (checkpoints / "step3").exists(), "a half-written checkpoint became visible"
    resumed = drive(tmp_path, "resume", 0, "resumed.pt")
    assert resumed["global_steps"] == 2
    assert_same_masters(resumed["masters"], saved["masters"])


@pytest.fixture
def small_filesystem(tmp_path):
    """A 64 MiB ext4 image, loop-mounted (CI runs as root)."""
    image, mount_point = tmp_path / "disk.img", tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
    # -m 0: no blocks reserved for root (the tests run as root and would write into them).
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount a test filesystem here: {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(folder):
    """Take every free block of the filesystem of ``folder`` (a new filler file each call)."""
    descriptor = os.open(os.path.join(folder, f"filler{len(os.listdir(folder))}"), os.O_WRONLY | os.O_CREAT, 0o600)
    allocated, chunk = 0, 1 << 30
    while chunk >= 4096:
        try:
            os.posix_fallocate(descriptor, allocated, chunk)
            allocated += chunk
        except OSError:
            chunk //= 2
    os.close(descriptor)


def test_full_disk_gives_clear_errors_and_the_last_checkpoint_loads(small_filesystem):
    from greedysnake_run import make_engine
    from ds_greedysnake.storage.checkpoint import CheckpointError
    from ds_greedysnake.storage.ssd import SsdIoError

    nvme, checkpoints = small_filesystem / "nvme", str(small_filesystem / "checkpoints")
    engine, batches = make_engine(str(nvme), 2, hidden=128, greedysnake={"activation_host_memory_mb": 0})
    engine.train_batch(batches)  # creates (and preallocates) the activation spill files
    engine.save_checkpoint(checkpoints, tag="good")
    good = {layer.index: engine.optimizer.read_master(layer) for layer in engine.layers}

    fill(str(small_filesystem))
    # Training goes on: every region was preallocated, so a full disk cannot corrupt a swap.
    engine.train_batch(batches)
    with pytest.raises(CheckpointError, match=r"writing checkpoint (file|folder) .*checkpoints/\.tmp\.full.* failed"):
        engine.save_checkpoint(checkpoints, tag="full")
    assert (small_filesystem / "checkpoints" / "latest").read_text() == "good"
    assert not any(name.startswith(".tmp") for name in os.listdir(checkpoints)), "staging left behind"

    # A swap that needs new space (a bigger micro-batch's checkpoints) fails naming file and bytes.
    fill(str(small_filesystem / "checkpoints"))  # what the abandoned checkpoint freed
    big_batches = ((inputs.repeat(4, 1), labels.repeat(4, 1)) for inputs, labels in batches)
    with pytest.raises(SsdIoError, match=r"no space left to allocate \d+ bytes for .*act_l1_m\d\.bin"):
        engine.train_batch(big_batches)

    engine.load_checkpoint(checkpoints)
    for layer in engine.layers:
        assert torch.equal(engine.optimizer.read_master(layer), good[layer.index])
    for folder in (small_filesystem, small_filesystem / "checkpoints"):
        for name in os.listdir(folder):
            if name.startswith("filler"):
                os.remove(folder / name)
    engine.train_batch(batches)  # and training resumes once there is space again
    engine.close()
    shutil.rmtree(nvme, ignore_errors=True)


# Safe loading, another rank count, damaged shards (issue 25). One in-process engine of the model
# dp_driver.py trains, so that it can load the checkpoints the multi-rank runs save.

# dp_driver.py's --warmup-lr schedule (its weights move from the first step on).
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 2e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 3}}
GLOBAL_MICRO_BATCHES = 4


class CreatesFile:
    """Unpickling this creates ``path``: what a foreign checkpoint could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(scope="module")
def engine_and_batches(tmp_path_factory):
    from greedysnake_run import make_engine
    engine, batches = make_engine(str(tmp_path_factory.mktemp("nvme")), GLOBAL_MICRO_BATCHES, scheduler=WARMUP,
                                  greedysnake={"save_total_limit": 2})
    yield engine, batches
    engine.close()


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory):
    """A checkpoint of 2 steps on 2 ranks of 2 micro-batches each (the folder 'latest' is in)."""
    from test_data_parallel import launch
    folder = tmp_path_factory.mktemp("two_ranks")
    launch(folder, 2, 2, 2, "saving", extra=["--warmup-lr", "--save", str(folder / "checkpoints")])
    return folder / "checkpoints"


def snapshot(engine):
    """Everything a load overwrites: every layer's states, the counters, the lr schedule, and the
    weights training computes with (their loss on fixed data)."""
    from helpers import data, tiny_gpt_config
    states = {layer.index: engine.optimizer.read_layer_state(layer) for layer in engine.layers}
    fixed = data(tiny_gpt_config(), seed=1)
    loss = float(engine.eval_batch(fixed))
    return {"states": {index: (s.master, s.exp_avg, s.exp_avg_sq) for index, s in states.items()}, "loss": loss,
            "counters": (engine.global_steps, engine.global_samples, engine.optimizer.step_count,
                         engine.optimizer.param_groups[0]["lr"], engine.lr_scheduler.state_dict())}


def assert_same_snapshot(first, second):
    assert first["counters"] == second["counters"] and first["loss"] == second["loss"]
    for index, parts in second["states"].items():
        assert all(torch.equal(a, b) for a, b in zip(first["states"][index], parts)), f"layer {index}"


def test_a_foreign_pickle_is_refused_and_loads_only_when_trusted(tmp_path, engine_and_batches):
    from ds_greedysnake.storage.checkpoint import CheckpointError
    engine, batches = engine_and_batches
    engine.train_batch(batches)
    engine.save_checkpoint(str(tmp_path), tag="saved")
    saved = snapshot(engine)
    marker, state_file = tmp_path / "created_by_unpickling", tmp_path / "saved" / "state.pt"
    state = torch.load(str(state_file), weights_only=True)
    state["client_state"] = {"payload": CreatesFile(str(marker))}
    torch.save(state, str(state_file))
    engine.train_batch(batches)
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match=r"saved/state\.pt holds .*open.*trust_pickle=True"):
        engine.load_checkpoint(str(tmp_path), tag="saved")
    assert not marker.exists(), "unpickling ran"
    assert_same_snapshot(snapshot(engine), before)
    _, client_state = engine.load_checkpoint(str(tmp_path), tag="saved", trust_pickle=True)
    assert marker.exists()
    client_state["payload"].close()
    assert_same_snapshot(snapshot(engine), saved)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_shard_is_named_and_nothing_is_loaded(tmp_path, engine_and_batches,
                                                                     saved_on_two_ranks, damage):
    from ds_greedysnake.storage.checkpoint import CheckpointError
    engine, batches = engine_and_batches
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(saved_on_two_ranks, checkpoints)
    # The last layer's: a load that checked each shard only when it came to it would have overwritten the others.
    shard = checkpoints / "step2" / f"layer_{len(engine.layers) - 1}.rank1.safetensors"
    if damage == "missing":
        shard.unlink()
    else:
        os.truncate(shard, shard.stat().st_size // 2)
    engine.train_batch(batches)
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match=re.escape(f"shard {shard} is {damage}")):
        engine.load_checkpoint(str(checkpoints))
    assert_same_snapshot(snapshot(engine), before)


def test_a_shard_missing_for_one_rank_stops_every_rank_before_loading(tmp_path, saved_on_two_ranks):
    """Rank 0 of 2 needs only rank 0's shards: it must not load alone while rank 1 cannot."""
    from test_data_parallel import launch
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(saved_on_two_ranks, checkpoints)
    shard = checkpoints / "step2" / "layer_1.rank1.safetensors"
    shard.unlink()
    (first_code, first_output), (second_code, second_output) = launch(
        tmp_path, 2, 2, 1, "damaged", extra=["--warmup-lr", "--load", str(checkpoints)], expect_success=False)
    assert first_code != 0 and second_code != 0
    assert f"shard {shard} is missing" in second_output
    assert "cannot be loaded by rank(s) [1]" in first_output and "nothing was loaded on any rank" in first_output


def test_save_total_limit_keeps_the_last_checkpoints(tmp_path, engine_and_batches):
    engine, _ = engine_and_batches
    for tag in ("a", "b", "c"):
        engine.save_checkpoint(str(tmp_path), tag=tag)
    assert sorted(os.listdir(tmp_path)) == ["b", "c", "latest", "zero_to_fp32.py"]  # DeepSpeed's recovery script too


def scheduled_reference(steps):
    """Plain PyTorch AdamW straight through ``steps`` global batches, its lr set by DeepSpeed's WarmupLR
    as the engine's is (stepped after each optimizer step)."""
    from deepspeed.runtime.lr_schedules import WarmupLR
    from ds_greedysnake.models.gpt import lm_loss
    from helpers import data, fresh_model, tiny_gpt_config
    config = tiny_gpt_config()
    model = fresh_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    scheduler = WarmupLR(optimizer, **WARMUP["params"])
    batches = data(config)
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(GLOBAL_MICRO_BATCHES):
            inputs, labels = next(batches)
            (lm_loss(model(inputs), labels) / GLOBAL_MICRO_BATCHES).backward()
        optimizer.step()
        scheduler.step()
    return {name: param.detach() for name, param in model.named_parameters()}, optimizer.param_groups[0]["lr"]


def resume_on(tmp_path, checkpoints, ranks):
    """2 more steps on ``ranks`` ranks from the checkpoint, compared with PyTorch straight through 4."""
    from test_data_parallel import launch, relative_l2
    resumed = launch(tmp_path, ranks, GLOBAL_MICRO_BATCHES // ranks, 2, f"resumed_on_{ranks}",
                     extra=["--warmup-lr", "--load", str(checkpoints)])
    expected, expected_lr = scheduled_reference(4)
    assert relative_l2(resumed["masters"], expected) <= 1e-5
    assert resumed["global_steps"] == resumed["step_count"] == 4
    assert resumed["lr"] == expected_lr


@pytest.mark.parametrize("ranks", [1, 2])
def test_saved_on_two_ranks_resumes_on_one_or_two_as_pytorch_trains(tmp_path, saved_on_two_ranks, ranks):
    resume_on(tmp_path, saved_on_two_ranks, ranks)


def test_saved_on_one_rank_resumes_on_two_as_pytorch_trains(tmp_path):
    from test_data_parallel import launch
    launch(tmp_path, 1, GLOBAL_MICRO_BATCHES, 2, "saving",
           extra=["--warmup-lr", "--save", str(tmp_path / "checkpoints")])
    resume_on(tmp_path, tmp_path / "checkpoints", 2)
