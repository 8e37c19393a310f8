"""How fast aio reads into a process's locked buffers run, set after set, in fresh processes.

    python scripts/bench/buffer_pages.py                        # 3 processes, 6 buffer sets of 504 MiB each
    python scripts/bench/buffer_pages.py --churn-gib 3          # another process touches and frees 3 GiB first

Both engines read and write the SSD through DeepSpeed's aio handle into host buffers it locks (on the CPU
accelerator; ZeRO-3's swappers do the same on every accelerator). On this project's virtual machine the rate
of the same reads of the same files moved up to 2x with the buffers alone (docs/planner.md, "Why a run's disk
rate moved"): each child here allocates ``--sets`` sets of ``--buffers`` locked buffers one after the other,
keeping every set, and times ``--reads`` reads of the same files into each; it prints GB/s per set, and the
kernel's transparent huge page mode (under "madvise" the buffers are 4 KiB pages wherever the allocator
finds them). A benchmark of the machine, not of either engine.
"""
import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))

MIB = 2**20


def child(args) -> None:
    """One process: the buffer sets, each read ``args.reads`` times; one line of GB/s per set."""
    from ds_greedysnake import deepspeed_compat
    handle = deepspeed_compat.new_aio_handle(deepspeed_compat.AioSettings())
    paths = [os.path.join(args.folder, f"part{index}.bin") for index in range(args.buffers)]
    size = args.mib * MIB
    rates, kept = [], []
    for _ in range(args.sets):
        buffers = [deepspeed_compat.zero_swap_buffer(handle, size).zero_() for _ in paths]
        kept.append(buffers)  # kept: the next set is other memory
        per_read = []
        for _ in range(args.reads):
            started = time.perf_counter()
            for buffer, path in zip(buffers, paths):
                handle.pread(buffer, path, False, True, 0)
            if handle.wait() != len(paths):
                raise OSError(f"aio reads of {len(paths)} files in {args.folder} did not all complete")
            per_read.append(size * len(paths) / (time.perf_counter() - started) / 1e9)
        rates.append("/".join(f"{rate:.2f}" for rate in per_read))
    print(" ".join(rates), flush=True)


def write_files(args) -> None:
    """The files every child reads, written once (plain writes: their speed is not measured)."""
    os.makedirs(args.folder, exist_ok=True)
    block = os.urandom(MIB)
    for index in range(args.buffers):
        with open(os.path.join(args.folder, f"part{index}.bin"), "wb") as handle:
            for _ in range(args.mib):
                handle.write(block)
    os.sync()


def churn(gib: float) -> None:
    """Another process touches ``gib`` GiB and exits, as a finished run frees its memory."""
    subprocess.run([sys.executable, "-c", f"import torch; torch.ones({int(gib * 2**28)})"], check=True)
    time.sleep(2.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=os.path.join(REPO, ".nvme_swap", "buffer_pages"),
                        help="a folder on the SSD (the files are written once and read by every process)")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--sets", type=int, default=6, help="buffer sets per process, allocated one after another")
    parser.add_argument("--buffers", type=int, default=18, help="buffers (and files) per set")
    parser.add_argument("--mib", type=int, default=28, help="MiB per buffer (and file)")
    parser.add_argument("--reads", type=int, default=2, help="reads of every file into each set")
    parser.add_argument("--churn-gib", type=float, default=0.0,
                        help="before each process, another touches and frees this many GiB")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("processes", "sets", "buffers", "mib", "reads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.child:
        child(args)
        sys.stdout.flush()
        os._exit(0)  # DeepSpeed's native threads have aborted at interpreter exit here
    write_files(args)
    try:
        return measure(args)
    finally:
        for index in range(args.buffers):  # the files go; the folder stays (it may be the user's)
            os.remove(os.path.join(args.folder, f"part{index}.bin"))


def measure(args) -> int:
    """Each process in turn (after the churn, if asked); one line per process."""
    from saturation_accuracy import transparent_hugepages
    print(f"transparent huge pages: {transparent_hugepages()}; {args.buffers} locked buffers of {args.mib} MiB "
          f"per set, GB/s per read, sets in allocation order:")
    forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ("folder", "sets", "buffers", "mib",
                                                                                 "reads")]
    for process in range(args.processes):
        if args.churn_gib:
            churn(args.churn_gib)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *forwarded],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = [line for line in done.stdout.splitlines() if line and "WARNING" not in line]
        if done.returncode != 0 or not lines:
            print(done.stdout[-3000:], file=sys.stderr)
            return done.returncode
        print(f"process {process + 1}: {lines[-1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
