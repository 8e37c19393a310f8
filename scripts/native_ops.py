"""Set-up's checks of DeepSpeed's native ops (scripts/setup.sh calls them; each runs alone too).

    python scripts/native_ops.py check 0.19.8   # exit 0 when DeepSpeed 0.19.8 is installed with every op prebuilt
    python scripts/native_ops.py report         # load every op (compiling none), print the CPU Adam SIMD flavour,
                                                # clear stale build locks (as `locks` does)
    python scripts/native_ops.py locks          # torch-extensions build locks: stale ones removed, live ones named
    python scripts/native_ops.py worker         # the optimizer worker's CPU ops, built when DeepSpeed's install was
                                                # made for a GPU (nothing to do on a CPU machine)
    python scripts/native_ops.py arch-list 9.0a     # TORCH_CUDA_ARCH_LIST as DeepSpeed's op builds read it (9.0)
    python scripts/native_ops.py build --accelerator cpu [--ops cpu_adam ...]
                                                # build the ops for an accelerator the install was not made for

The ops are compiled once, when set-up installs DeepSpeed (scripts/install_deepspeed.sh); a run that
finds one missing compiles it and logs that it does (ds_greedysnake.deepspeed_compat). DeepSpeed uses an
installed op only under the accelerator its install was made for, so the optimizer worker (DeepSpeed's
CPU accelerator) beside a GPU install, or any process beside a DeepSpeed wheel without ops, loads the
ones `build` compiled into ds_greedysnake.prebuilt_ops.folder(ACCELERATOR).
"""
import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def check(version: str) -> int:
    try:
        import deepspeed
        from ds_greedysnake import deepspeed_compat
    except ImportError as error:
        print(f"ds_greedysnake set-up: DeepSpeed is not installed yet ({error})")
        return 1
    os.environ[deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV] = "1"  # checking must not compile anything
    if deepspeed.__version__ != version:
        print(f"ds_greedysnake set-up: DeepSpeed {deepspeed.__version__} is installed, {version} is pinned")
        return 1
    missing = [name for name, prebuilt in deepspeed_compat.native_ops_status().items() if not prebuilt]
    if missing:
        print(f"ds_greedysnake set-up: DeepSpeed {version} is installed without these ops prebuilt: {', '.join(missing)}")
        return 1
    for name in deepspeed_compat.native_ops_status():
        try:
            deepspeed_compat.load_native_op(name)
        except Exception as error:  # built for another torch, or broken: build again
            print(f"ds_greedysnake set-up: DeepSpeed's prebuilt {name} op does not load ({error})")
            return 1
    return 0


def report() -> int:
    import deepspeed
    from ds_greedysnake import deepspeed_compat
    os.environ[deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV] = "1"  # loading must not compile anything
    status = deepspeed_compat.native_ops_status()
    missing = [name for name, prebuilt in status.items() if not prebuilt]
    if missing:
        for name in missing:  # DeepSpeed's install skips an op it finds it cannot build; it says why here
            deepspeed_compat.native_op_compatible(name, verbose=True)
        print(f"ds_greedysnake set-up: DeepSpeed's ops {', '.join(missing)} are not prebuilt (async_io needs "
              "libaio-dev); see the build log in .cache/deepspeed_build.log", file=sys.stderr)
        return 1
    locks()  # set-up compiles nothing itself; a lock left by an older JIT build would stall a fallback
    folders = {}
    for name in status:
        folders.setdefault(_folder_of(deepspeed_compat.load_native_op(name)), []).append(name)
    for folder, names in folders.items():
        print(f"ds_greedysnake set-up: DeepSpeed {deepspeed.__version__}'s native ops {', '.join(names)} are prebuilt "
              f"into {folder}; no run compiles them")
    if deepspeed_compat.current_accelerator() != deepspeed_compat.WORKER_ACCELERATOR:
        try:
            deepspeed_compat.check_worker_ops()
        except deepspeed_compat.NativeOpNotPrebuiltError as error:
            print(f"ds_greedysnake set-up: {error}", file=sys.stderr)
            return 1
        print(f"ds_greedysnake set-up: the optimizer worker's ops {', '.join(deepspeed_compat.WORKER_OPS)} are "
              "prebuilt for DeepSpeed's CPU accelerator; no worker compiles them")
    flavour = deepspeed_compat.cpu_adam_simd_flavour()
    print(f"ds_greedysnake set-up: CPU Adam is built for {flavour} on this machine; every process of every job "
          "loads this one build")
    return 0


def locks() -> int:
    from ds_greedysnake import build_locks
    root = build_locks.extensions_root()
    for lock in build_locks.scan(root, clear=True):
        print(f"ds_greedysnake set-up: {lock.report()}")
    return 0


def _folder_of(module) -> str:
    """The installed DeepSpeed's ops folder, or the set-up folder an op was loaded from."""
    import deepspeed
    installed = os.path.join(os.path.dirname(deepspeed.__file__), "ops")
    return installed if os.path.abspath(module.__file__).startswith(installed) else os.path.dirname(
        os.path.dirname(os.path.abspath(module.__file__)))


# Built in parallel, one process each; async_io imports pin_memory's symbols, so that one comes first.
_BUILD_GROUPS = (("pin_memory", "async_io"), ("cpu_adam",), ("deepspeed_shm_comm",))


def _accelerator_environment(accelerator: str) -> dict:
    from ds_greedysnake import deepspeed_compat
    if accelerator == deepspeed_compat.WORKER_ACCELERATOR:
        from ds_greedysnake.optim.updates import WORKER_HIDDEN_ACCELERATORS
        env = dict(os.environ, **WORKER_HIDDEN_ACCELERATORS)  # as the worker runs: no GPU in sight
    else:
        env = dict(os.environ, DS_ACCELERATOR=accelerator)
    env.pop(deepspeed_compat.REQUIRE_PREBUILT_OPS_ENV, None)  # compiling is the point here
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def build(accelerator: str, ops) -> int:
    """Compiles ``ops`` (default every native op ``accelerator`` has) for ``accelerator``, a process per group."""
    from ds_greedysnake.deepspeed_compat import NATIVE_OPS
    unknown = sorted(set(ops or ()) - set(NATIVE_OPS))
    if unknown:
        print(f"ds_greedysnake set-up: no native op {', '.join(unknown)}; the ops are {', '.join(NATIVE_OPS)}",
              file=sys.stderr)
        return 2
    groups = [[name for name in group if ops is None or name in ops] for group in _BUILD_GROUPS]
    if ops is not None and "async_io" in ops and "pin_memory" not in ops:
        groups[0].insert(0, "pin_memory")  # async_io cannot be imported without it
    groups = [group for group in groups if group]
    env = _accelerator_environment(accelerator)
    started = time.monotonic()

    def run(group):
        command = [sys.executable, os.path.abspath(__file__), "build-here", accelerator, *group]
        return group, subprocess.run(command, env=env, capture_output=True, text=True)

    failed = 0
    with ThreadPoolExecutor(len(groups)) as pool:
        for group, done in pool.map(run, groups):
            sys.stdout.write(done.stdout)
            if done.returncode != 0:
                sys.stderr.write(done.stderr[-4000:])
                print(f"ds_greedysnake set-up: building {', '.join(group)} for the {accelerator} accelerator failed",
                      file=sys.stderr)
                failed = 1
    print(f"ds_greedysnake set-up: the {accelerator} accelerator's ops built in {time.monotonic() - started:.0f} s")
    return failed


def build_here(accelerator: str, names) -> int:
    """One build group, in the process build() started under ``accelerator``."""
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    from ds_greedysnake import deepspeed_compat, prebuilt_ops
    running = deepspeed_compat.current_accelerator()
    if running != accelerator:
        print(f"ds_greedysnake set-up: DeepSpeed runs the {running} accelerator here, not {accelerator} "
              f"(DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')})", file=sys.stderr)
        return 1
    names = [name for name in names if name in ALL_OPS]  # deepspeed_shm_comm is the CPU accelerator's only
    for name in names:
        if not deepspeed_compat.native_op_compatible(name, verbose=True):
            print(f"ds_greedysnake set-up: DeepSpeed cannot build {name} for the {accelerator} accelerator here "
                  "(async_io needs libaio: its headers and library, found through CPATH/LIBRARY_PATH or "
                  "CFLAGS/LDFLAGS)", file=sys.stderr)
            return 1
    started = time.monotonic()
    for op in deepspeed_compat.build_for_set_up(names):
        print(f"ds_greedysnake set-up: {op.name} built for the {accelerator} accelerator: {op.file}")
    if names:
        print(f"ds_greedysnake set-up: {', '.join(names)} ({accelerator}) in {time.monotonic() - started:.0f} s "
              f"into {prebuilt_ops.folder(accelerator)}")
    return 0


def worker() -> int:
    """The optimizer worker's CPU ops: nothing to do where DeepSpeed's install has them (a CPU machine)."""
    from ds_greedysnake import deepspeed_compat
    missing = deepspeed_compat.missing_worker_ops()
    if not missing:
        return 0
    from deepspeed.git_version_info import accelerator_name
    print(f"ds_greedysnake set-up: DeepSpeed was installed for the {accelerator_name or 'no'} accelerator; the "
          f"optimizer worker runs on the CPU one: building its ops {', '.join(missing)} for it")
    return build(deepspeed_compat.WORKER_ACCELERATOR, list(deepspeed_compat.WORKER_OPS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check").add_argument("version", help="the DeepSpeed release setup.py pins")
    commands.add_parser("report")
    commands.add_parser("locks")
    commands.add_parser("worker")
    builder = commands.add_parser("build")
    builder.add_argument("--accelerator", required=True, help="DeepSpeed's accelerator name: cpu, cuda")
    builder.add_argument("--ops", nargs="+", help="default: every native op the accelerator has")
    commands.add_parser("arch-list").add_argument("value", help="a TORCH_CUDA_ARCH_LIST, e.g. 9.0a")
    here = commands.add_parser("build-here")  # build()'s own processes
    here.add_argument("accelerator")
    here.add_argument("ops", nargs="+")
    args = parser.parse_args()
    if args.command == "check":
        return check(args.version)
    if args.command == "build":
        return build(args.accelerator, args.ops)
    if args.command == "build-here":
        return build_here(args.accelerator, args.ops)
    if args.command == "worker":
        return worker()
    if args.command == "arch-list":  # install_deepspeed.sh: the list as DeepSpeed's install-time build reads it
        from ds_greedysnake.deepspeed_compat import builder_arch_list
        print(builder_arch_list(args.value))
        return 0
    return report() if args.command == "report" else locks()


if __name__ == "__main__":
    sys.exit(main())
