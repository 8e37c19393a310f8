"""Checkpoints: exact resume in a new process, survival of a kill at any point of a save, a full disk."""
import os
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
    from ds_greedysnake.checkpoint import CheckpointError
    from ds_greedysnake.ssd import SsdIoError

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
