"""Set-up's checks of DeepSpeed's native ops (scripts/setup.sh calls them; each runs alone too).

    python scripts/native_ops.py check 0.19.8   # exit 0 when DeepSpeed 0.19.8 is installed with every op prebuilt
    python scripts/native_ops.py report         # load every op (compiling none), print the CPU Adam SIMD flavour,
                                                # clear stale build locks (as `locks` does)
    python scripts/native_ops.py locks          # torch-extensions build locks: stale ones removed, live ones named

The ops are compiled once, when set-up installs DeepSpeed (scripts/install_deepspeed.sh); a run that
finds one missing compiles it and logs that it does (ds_greedysnake.deepspeed_compat).
"""
import argparse
import os
import sys

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
    for name in status:
        deepspeed_compat.load_native_op(name)
    flavour = deepspeed_compat.cpu_adam_simd_flavour()
    print(f"ds_greedysnake set-up: DeepSpeed {deepspeed.__version__}'s native ops {', '.join(status)} are prebuilt "
          f"into {os.path.join(os.path.dirname(deepspeed.__file__), 'ops')}; no run compiles them")
    print(f"ds_greedysnake set-up: CPU Adam is built for {flavour} on this machine; every process of every job "
          "loads this one build")
    return 0


def locks() -> int:
    from ds_greedysnake import build_locks
    root = build_locks.extensions_root()
    for lock in build_locks.scan(root, clear=True):
        print(f"ds_greedysnake set-up: {lock.report()}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check").add_argument("version", help="the DeepSpeed release setup.py pins")
    commands.add_parser("report")
    commands.add_parser("locks")
    args = parser.parse_args()
    if args.command == "check":
        return check(args.version)
    return report() if args.command == "report" else locks()


if __name__ == "__main__":
    sys.exit(main())
