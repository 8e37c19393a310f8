"""Test session set-up: DeepSpeed's CPU accelerator, a one-process 'launch', and clean-up of the
shared-memory buffer DeepSpeed's CPU comm op leaves in /dev/shm."""
import os
import socket
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                   ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(key, value)
os.environ.setdefault("MASTER_PORT", _free_port())

import native_ops_guard  # noqa: E402  (tests/native_ops_guard.py: the session compiles no native op)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs with real SSD I/O (CI runs them too)")


def pytest_sessionstart(session):
    native_ops_guard.session_start(session)


def pytest_sessionfinish(session, exitstatus):
    native_ops_guard.session_finish(session)
    # DeepSpeed's shm comm op names its buffer deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    # and never removes it; remove ours (by our port) so repeated runs do not fill /dev/shm.
    from helpers import remove_shm_buffers
    remove_shm_buffers(os.environ["MASTER_PORT"])
