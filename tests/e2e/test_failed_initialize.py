"""A failed initialize releases everything it opened: a script that catches the error and retries (elsewhere,
or after fixing its config) ends with the descriptors, threads, locked memory and processes it began with."""
import collections
import os

import pytest

from ds_greedysnake.storage import ssd_layout
from greedysnake_run import make_engine

pytestmark = pytest.mark.slow

# Gradients and optimizer states through SSD, and the overlapped worker: every kind of resource is opened.
ON_SSD = {"gradient_host_memory_mb": 0, "optimizer_host_memory_mb": 0}
# Host slots for both (memfd shared memory the worker maps).
IN_HOST_MEMORY = {"gradient_host_memory_mb": 64, "optimizer_host_memory_mb": 64}


def open_descriptors(under: str = ""):
    """This process's open descriptors (their targets), those into ``under`` only when given."""
    targets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{name}"))
        except FileNotFoundError:
            pass  # the listing's own descriptor, closed by now
    return sorted(target for target in targets if target.startswith(under))


def child_processes():
    children = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == os.getpid():  # a zombie too: a worker never waited for
            children.append(int(pid))
    return children


def locked_kib() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmLck:"))


def resources(tmp_path):
    """What a leak would grow: descriptors (all, and any into the swap folders), threads (each aio handle
    runs its own), locked host memory (the aio buffers), child processes (the optimizer worker) and
    /dev/shm entries."""
    return {"descriptors": len(open_descriptors()), "into swap folders": open_descriptors(str(tmp_path)),
            "threads": len(os.listdir("/proc/self/task")), "locked KiB": locked_kib(),
            "children": child_processes(), "/dev/shm": sorted(os.listdir("/dev/shm"))}


def train_one_step_and_close(nvme_path: str, **greedysnake):
    engine, batches = make_engine(nvme_path, 2, greedysnake=greedysnake)
    loss = float(engine.train_batch(batches))
    engine.close()
    return loss


def no_space(monkeypatch):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(ssd_layout.shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 4096, 4096))


@pytest.mark.parametrize("placement", [ON_SSD, IN_HOST_MEMORY], ids=["on SSD", "in host memory"])
def test_failed_initializes_leak_nothing_and_a_retry_trains(tmp_path, monkeypatch, placement):
    # A first run in this process creates what lives as long as it (the process group, DeepSpeed's shm
    # buffer, torch's thread pools): the baseline is taken after it.
    first_loss = train_one_step_and_close(str(tmp_path / "warm"), **placement)
    before = resources(tmp_path)

    # Early: the disk cannot hold the regions (the lock, the stores' aio handles and buffers are open).
    with monkeypatch.context() as patch:
        no_space(patch)
        with pytest.raises(ssd_layout.SsdSpaceError, match="cannot hold this run"):
            make_engine(str(tmp_path / "small"), 2, greedysnake=placement)
    assert resources(tmp_path) == before

    # Late: DeepSpeed's constructor fails after the optimizer is built (every region created, the worker
    # started, the parameters written): a scheduler given a parameter it does not take.
    with pytest.raises(TypeError, match="warmup_typo"):
        make_engine(str(tmp_path / "retry"), 2, greedysnake=placement,
                    scheduler={"type": "WarmupLR", "params": {"warmup_typo": 3}})
    assert resources(tmp_path) == before

    # The same swap folder again, fixed: it trains as a fresh run does, and closing leaves nothing behind.
    assert train_one_step_and_close(str(tmp_path / "retry"), **placement) == first_loss
    assert resources(tmp_path) == before
