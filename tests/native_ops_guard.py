"""The test session compiles no native op: set-up prebuilt DeepSpeed's ops into the installed package.

With every op prebuilt, the session runs under DS_GREEDYSNAKE_REQUIRE_PREBUILT_OPS=1 (an op a test or
one of its child processes would compile is an error, not minutes of compiling) and fails at its end
if a file under the torch-extensions folder or a prebuilt op file changed. With some op not prebuilt
(a venv an older set-up made), it says so and checks nothing: `bash scripts/setup.sh` builds them."""
import glob
import os

import pytest

_SNAPSHOT = pytest.StashKey[dict]()


def _build_files() -> dict:
    """path -> (size, mtime) of every file a build of an op writes: torch's JIT folders, the prebuilt ops."""
    import deepspeed
    from ds_greedysnake import build_locks
    paths = glob.glob(os.path.join(build_locks.extensions_root(), "**"), recursive=True)
    paths += glob.glob(os.path.join(os.path.dirname(deepspeed.__file__), "ops", "**", "*.so"), recursive=True)
    files = {}
    for path in paths:
        if os.path.isfile(path):
            stat = os.stat(path)
            files[path] = (stat.st_size, stat.st_mtime_ns)
    return files


def _say(session, line: str, **markup) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write("\n")  # after the progress line's "[100%]"
        reporter.write_line(line, **markup)


def session_start(session) -> None:
    from ds_greedysnake import deepspeed_compat
    missing = [name for name, prebuilt in deepspeed_compat.native_ops_status().items() if not prebuilt]
    if missing:
        _say(session, f"native ops not prebuilt in this venv ({', '.join(missing)}): tests will compile them; "
                      f"`{deepspeed_compat.SETUP_COMMAND}` prebuilds them", yellow=True)
        return
    os.environ[deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV] = "1"
    session.config.stash[_SNAPSHOT] = _build_files()


def session_finish(session) -> None:
    before = session.config.stash.get(_SNAPSHOT, None)
    if before is None:
        return
    after = _build_files()
    changed = sorted(path for path in set(before) | set(after) if before.get(path) != after.get(path))
    if changed:
        _say(session, "the test session compiled native ops (set-up prebuilds them; nothing may rebuild): "
                      + ", ".join(changed[:10]), red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
