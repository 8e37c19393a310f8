"""Build locks of torch's JIT extension builds: which are stale, and clearing them.

torch.utils.cpp_extension builds an op in ``<extensions root>/<op>/`` under a ``lock`` file it
creates with O_EXCL and keeps open until the build ends (``FileBaton``). A process that dies while
it builds leaves the file behind, and every later build of that op then waits on it forever,
printing nothing. The file holds no owner id; the owner is the process that still has it open, and
while a build runs ninja and the compiler work in the build folder. A lock that no process holds
open, with no process working in its folder, is stale.

Set-up and DeepSpeed's JIT path (see ``deepspeed_compat``) clear stale locks and name the process
that holds a live one. No torch import at module level (set-up scans before anything is loaded).
"""
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

LOCK_NAME = "lock"  # torch.utils.cpp_extension: FileBaton(os.path.join(build_directory, 'lock'))
# A lock younger than this is left alone even when nobody holds it: its owner may be between
# creating it and our scan of /proc (the owner keeps it open from creation, so this is margin).
MIN_STALE_AGE_SECONDS = 2.0


def extensions_root() -> str:
    """The folder torch JIT-builds extensions under, as torch.utils.cpp_extension picks it."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    import torch  # only for the default root: torch's cache folder and build flavour
    from torch.utils.cpp_extension import get_default_build_root
    if torch.version.hip is not None:
        flavour = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        flavour = "cu" + torch.version.cuda.replace(".", "")
    else:
        flavour = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{flavour}")


@dataclass
class BuildLock:
    """One build folder's lock file and who, if anyone, is behind it."""
    path: str
    holders: List[int] = field(default_factory=list)  # pids with the lock open or working in its folder
    unreadable: int = 0  # processes of the lock's owner whose open files could not be read
    removed: bool = False  # cleared by clear_if_stale

    @property
    def stale(self) -> bool:
        return not self.holders and self.unreadable == 0

    def describe(self) -> str:
        if self.holders:
            owners = ", ".join(f"{pid} ({_command_line(pid)})" for pid in self.holders)
            return (f"build lock {self.path} is held by process {owners}, which is building the op; if it is "
                    f"stuck, stop it and remove {self.path}")
        if self.unreadable:
            return (f"build lock {self.path} is held by no process that could be inspected ({self.unreadable} of its "
                    f"owner's could not be); if no one else is building this op, remove {self.path}")
        return f"stale build lock {self.path}: the process that created it is gone; remove {self.path}"

    def report(self) -> str:
        if self.removed:
            return (f"removed the stale build lock {self.path} (no process holds it: the build that created it "
                    "died); the op is built again from what is in its folder")
        return self.describe()


def inspect_lock(path: str) -> Optional[BuildLock]:
    """The lock at ``path`` and its holders, or None when there is no lock there."""
    try:
        lock_stat = os.stat(path)
    except FileNotFoundError:
        return None
    build_folder = os.path.realpath(os.path.dirname(path))
    lock = BuildLock(path)
    pids = _pids()
    if pids is None:
        lock.unreadable = 1  # no /proc: an owner cannot be told apart from none, so never stale
        return lock
    for pid in pids:
        try:
            # The creator owns the file and keeps it open: only processes of that user can hold it.
            if os.stat(f"/proc/{pid}").st_uid != lock_stat.st_uid:
                continue
            if _holds(pid, lock_stat) or _works_in(pid, build_folder):
                lock.holders.append(pid)
        except PermissionError:
            lock.unreadable += 1
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited during the scan
    return lock


def clear_if_stale(path: str) -> Optional[BuildLock]:
    """Remove the lock at ``path`` when its owner is gone; returns what was found (None: no lock there).

    The lock's inode and age are checked again after the scan, so a lock another process created
    meanwhile (same path, new file) is never removed."""
    try:
        before = os.stat(path)
    except FileNotFoundError:
        return None
    lock = inspect_lock(path)
    if lock is None:
        return None
    if not lock.stale:
        return lock
    try:
        after = os.stat(path)
    except FileNotFoundError:
        return lock  # released meanwhile
    if (after.st_ino, after.st_dev) != (before.st_ino, before.st_dev) or \
            time.time() - after.st_mtime < MIN_STALE_AGE_SECONDS:
        return lock
    try:
        os.remove(path)
    except FileNotFoundError:
        return lock
    lock.removed = True
    return lock


def wait_until_free(path: str, log: Callable[[str], None], poll_seconds: float = 0.5,
                    report_seconds: float = 30.0) -> None:
    """Return once no live process holds the lock at ``path``, clearing it when its owner is gone.

    torch waits on a lock in silence and forever, also once the process behind it has died (a
    compiler left running by a killed build keeps its folder busy for a while, then the lock is
    stale). Here every wait says who is behind it, again every ``report_seconds``."""
    last_report = None
    while True:
        lock = clear_if_stale(path)
        if lock is None:
            return
        if lock.removed:
            log(lock.report())
            return
        if last_report is None or time.monotonic() - last_report >= report_seconds:
            log(f"waiting: {lock.report()}")
            last_report = time.monotonic()
        time.sleep(poll_seconds)


def scan(root: str, clear: bool) -> List[BuildLock]:
    """Every build lock directly under ``root`` (one folder per op); stale ones removed when ``clear``."""
    if not os.path.isdir(root):
        return []
    found = []
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry, LOCK_NAME)
        lock = clear_if_stale(path) if clear else inspect_lock(path)
        if lock is not None:
            found.append(lock)
    return found


def _pids() -> Optional[List[int]]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except FileNotFoundError:
        return None


def _holds(pid: int, lock_stat: os.stat_result) -> bool:
    fd_folder = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_folder):  # PermissionError: a process this user cannot inspect
        try:
            target = os.stat(os.path.join(fd_folder, fd))
        except (FileNotFoundError, PermissionError):
            continue
        if (target.st_ino, target.st_dev) == (lock_stat.st_ino, lock_stat.st_dev):
            return True
    return False


def _works_in(pid: int, folder: str) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/cwd") == folder
    except OSError:  # a zombie has no cwd; some processes (init) hide theirs even from root
        return False


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120] or "?"
    except OSError:
        return "?"
