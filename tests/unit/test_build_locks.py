"""Build locks of torch's JIT builds: one whose owner died is stale and cleared, one a live process holds
(or works beside, in its build folder) is kept and its owner named, and a wait on it ends when it goes."""
import os
import subprocess
import sys
import time

import pytest

from ds_greedysnake import build_locks
from helpers import leave_lock_of_a_dead_build

# torch's FileBaton.try_acquire: create the lock with O_EXCL and keep it open until the build ends.
_ACQUIRE = "import os, sys; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)"


@pytest.fixture
def live_builder(tmp_path):
    """A process holding a fresh lock open, as a build in progress does; yields (pid, lock path)."""
    path = str(tmp_path / "cpu_adam" / build_locks.LOCK_NAME)
    os.makedirs(os.path.dirname(path))
    holder = subprocess.Popen([sys.executable, "-c", _ACQUIRE + "; print('held', flush=True); sys.stdin.read()", path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))  # old, so only its holder keeps it from being stale
    yield holder, path
    holder.kill()
    holder.wait()


def test_a_lock_left_by_a_dead_build_is_stale_and_cleared(tmp_path):
    path = leave_lock_of_a_dead_build(tmp_path / "async_io")
    assert build_locks.inspect_lock(path).stale
    lock = build_locks.clear_if_stale(path)
    assert lock.removed and not os.path.exists(path)
    assert f"removed the stale build lock {path}" in lock.report()
    assert build_locks.clear_if_stale(path) is None  # nothing left to do


def test_a_lock_a_live_build_holds_is_kept_and_its_owner_named(live_builder):
    holder, path = live_builder
    lock = build_locks.clear_if_stale(path)
    assert not lock.removed and os.path.exists(path)
    assert holder.pid in lock.holders
    assert f"held by process {holder.pid}" in lock.report() and f"remove {path}" in lock.report()
    holder.kill()
    holder.wait()
    assert build_locks.clear_if_stale(path).removed  # its owner gone, the same lock is now stale


def test_a_process_working_in_the_build_folder_keeps_the_lock(tmp_path):
    """A killed build's compiler may still run in the folder (ninja runs there); wait for it."""
    path = leave_lock_of_a_dead_build(tmp_path / "cpu_adam")
    compiler = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], cwd=os.path.dirname(path),
                                stdin=subprocess.PIPE)
    try:
        lock = build_locks.clear_if_stale(path)
        assert compiler.pid in lock.holders and os.path.exists(path)
    finally:
        compiler.kill()
        compiler.wait()


def test_a_fresh_lock_is_not_taken_for_stale(tmp_path):
    """Between its owner creating it and our scan a lock has no holder yet: a fresh one is left alone."""
    path = leave_lock_of_a_dead_build(tmp_path / "pin_memory")
    os.utime(path)  # just now
    assert not build_locks.clear_if_stale(path).removed and os.path.exists(path)


def test_waiting_names_the_holder_and_ends_when_the_build_does(live_builder):
    holder, path = live_builder
    lines = []

    def log(line):
        lines.append(line)
        if len(lines) == 1:
            holder.stdin.close()  # the build ends: its owner exits, leaving the lock behind as a kill would
        if len(lines) > 100:  # 10 s: fail rather than hang
            raise TimeoutError(lines[-1])

    build_locks.wait_until_free(path, log, poll_seconds=0.05, report_seconds=0.1)
    assert lines[0].startswith("waiting: ") and f"held by process {holder.pid}" in lines[0]
    assert lines[-1].startswith(f"removed the stale build lock {path}") and not os.path.exists(path)


def test_scan_reports_each_op_folder(tmp_path, live_builder):
    holder, held = live_builder
    stale = leave_lock_of_a_dead_build(tmp_path / "async_io")
    (tmp_path / "no_lock_here").mkdir()
    found = {lock.path: lock for lock in build_locks.scan(str(tmp_path), clear=True)}
    assert sorted(found) == sorted([held, stale])
    assert found[stale].removed and not found[held].removed and os.path.exists(held)
    assert build_locks.scan(str(tmp_path / "missing"), clear=True) == []
