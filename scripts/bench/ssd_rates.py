"""SSD rates by transfer size, through the engine's own store (DeepSpeed's aio handle, ab_bench's aio block).

    python scripts/bench/ssd_rates.py --nvme-path /mnt/nvme/scratch              # 4 to 256 MiB, 2 and 4 in flight
    python scripts/bench/ssd_rates.py --nvme-path ... --sizes-mib 12 38 256 --in-flight 2 4 --rounds 8 --json out.json

For each size: a write and a read of one region, then reads of several regions of that size in flight at
once, one per store (as training and the optimizer worker each read through their own store); a read and
a write in flight together (the optimizer worker's cycle); and a stream of reads of --stream regions one
after another, waited one at a time, with one read in flight and with two (the next read queued behind the
one being served, on a second aio handle: greedysnake's prefetch_depth 1 and 2). The sizes
are interleaved round after round, because this machine's virtual disk moved up to 1.9x within seconds
(docs/ab_bench.md): sizes measured one after the other would measure the drift. Prints MiB/s (median and
range over the rounds) as a markdown table; every file it writes is removed at the end.

The engine's transfers are layer-sized (12.6 MB for a parameter read on ab_bench's ssd_bound, 37.7 MB of
optimizer states per layer), while a benchmark's probe reads 256 MiB: on this machine the first ran at
about half the last's rate, which is why the A/B benchmark's roofline is not reachable at its own rates.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench", "ab_bench"))

MIB = 2**20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True, help="an existing folder on the SSD to measure")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 12, 36, 64, 256],
                        help="transfer sizes in MiB (default: 4 12 36 64 256)")
    parser.add_argument("--in-flight", type=int, nargs="*", default=[2, 4],
                        help="also read this many regions of each size at once (default: 2 4; none: only one)")
    parser.add_argument("--stream", type=int, default=8,
                        help="regions per size read one after another in the stream rows (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds after one warm-up round (default 5)")
    parser.add_argument("--aio", default=None, help="a JSON aio block replacing ab_bench's (DeepSpeed's keys)")
    parser.add_argument("--json", default=None, help="write the measurements here as JSON")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.nvme_path):
        parser.error(f"--nvme-path {args.nvme_path!r} is not an existing folder: create it on the SSD to measure")
    if any(size <= 0 for size in args.sizes_mib):
        parser.error(f"--sizes-mib must be positive, got {args.sizes_mib}")
    if any(count < 2 for count in args.in_flight):
        parser.error(f"--in-flight counts must be at least 2 (one region is always measured), got {args.in_flight}")
    if args.stream < 2:
        parser.error(f"--stream must be at least 2 regions, got {args.stream}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def aio_block(text) -> dict:
    from ab_bench_setup import AIO
    block = dict(AIO)
    if text:
        try:
            block.update(json.loads(text))
        except json.JSONDecodeError as error:
            raise SystemExit(f"--aio is not JSON ({error}): give e.g. '{{\"queue_depth\": 64}}'") from None
    return block


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def read_stream(store, regions, buffers) -> None:
    """Read ``regions`` in order, waiting for each before using it, with ``len(buffers)`` reads in flight
    (each on its own read handle of ``store``): the next reads are queued behind the one waited for."""
    depth = len(buffers)
    for index in range(min(depth, len(regions))):
        store.start_read(regions[index], buffers[index])
    for index in range(len(regions)):
        buffer = buffers[index % depth]
        store.wait_for_read(buffer)
        if index + depth < len(regions):
            store.start_read(regions[index + depth], buffer)


def measure(folder: str, aio: dict, sizes_mib, in_flight, rounds: int, stream: int = 8) -> dict:
    """{"rows": [{size_mib, transfer, seconds: [...]}, ...]}: the rounds' seconds of every transfer kind."""
    from ds_greedysnake.deepspeed_compat import aio_settings  # DeepSpeed's defaults for what --aio leaves out
    from ds_greedysnake.storage.ssd import IoCounters, SsdStore, padded_size
    scratch = tempfile.mkdtemp(prefix="ssd_rates_", dir=folder)
    stores, buffers = [], []
    try:
        stores = [SsdStore(scratch, aio_settings({"aio": aio}), IoCounters(), f"store{index}")
                  for index in range(max([1] + list(in_flight)))]
        targets = {}  # size -> [(store, region, buffer)], one per store
        for size in sizes_mib:
            targets[size] = []
            for store in stores:
                region = store.create_region(f"{size:g}mib", int(size * MIB), "probe")
                buffer = store.new_buffer(region)
                buffers.append((store, buffer))
                buffer.fill_(7)
                store.write(region, buffer)  # reads check the tag of what was written
                targets[size].append((store, region, buffer))
        # The stream rows: ``stream`` regions of each size on one store with two read handles.
        stream_store = SsdStore(scratch, aio_settings({"aio": aio}), IoCounters(), "stream", read_handles=2)
        stores.append(stream_store)
        stream_buffers = [stream_store.buffer(padded_size(int(max(sizes_mib) * MIB))) for _ in range(2)]
        buffers += [(stream_store, buffer) for buffer in stream_buffers]
        streams = {}
        for size in sizes_mib:
            streams[size] = [stream_store.create_region(f"stream{index}_{size:g}mib", int(size * MIB), "probe")
                             for index in range(stream)]
            for region in streams[size]:
                stream_store.write(region, stream_buffers[0])
        seconds = {}

        def read_and_write(size):
            """One region read while another is written (different stores, as the worker's read and write
            handles are different): the rate counts both transfers' bytes."""
            store, region, buffer = targets[size][0]

            def run():
                store.start_read(region, buffer)
                stream_store.start_write(streams[size][0], stream_buffers[0])
                store.wait()
                stream_store.wait()
            return run

        def read_together(size, count):
            def run():
                for store, region, buffer in targets[size][:count]:
                    store.start_read(region, buffer)
                for store, _, _ in targets[size][:count]:
                    store.wait()
            return run

        for round_index in range(rounds + 1):  # the first round warms up
            for size in sizes_mib:
                store, region, buffer = targets[size][0]
                measured = [("write", 1, timed(lambda: store.write(region, buffer))),
                            ("read", 1, timed(lambda: store.read(region, buffer)))]
                measured += [(f"read, {count} in flight", count, timed(read_together(size, count)))
                             for count in in_flight]
                measured.append(("read + write at once", 2, timed(read_and_write(size))))
                measured += [(f"stream of {stream}, {depth} in flight", stream,
                              timed(lambda: read_stream(stream_store, streams[size], stream_buffers[:depth])))
                             for depth in (1, 2)]
                if round_index:
                    for transfer, count, elapsed in measured:
                        seconds.setdefault((size, transfer, count), []).append(elapsed)
        rows = []
        for (size, transfer, count), times in seconds.items():
            rates = [count * size / elapsed for elapsed in times]
            rows.append({"size_mib": size, "transfer": transfer, "regions": count, "seconds": times,
                         "mib_per_s_median": statistics.median(rates), "mib_per_s_min": min(rates),
                         "mib_per_s_max": max(rates)})
        return {"rows": rows}
    finally:
        for store, buffer in buffers:
            store.free_buffer(buffer)
        shutil.rmtree(scratch, ignore_errors=True)


def markdown(result: dict) -> str:
    lines = ["| size (MiB) | transfer | MiB/s, median | MiB/s, range |", "|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['size_mib']:g} | {row['transfer']} | {row['mib_per_s_median']:.0f} | "
                     f"{row['mib_per_s_min']:.0f}-{row['mib_per_s_max']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    aio = aio_block(args.aio)
    started = time.time()
    result = measure(args.nvme_path, aio, args.sizes_mib, args.in_flight, args.rounds, args.stream)
    result.update({"aio": aio, "nvme_path": os.path.abspath(args.nvme_path), "rounds": args.rounds,
                   "machine": os.uname().nodename, "cpus": os.cpu_count(),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)) + " UTC",
                   "wall_seconds": time.time() - started})
    print(markdown(result))
    print(f"\n{args.rounds} rounds after a warm-up, sizes interleaved; aio {aio}; {result['wall_seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    # DeepSpeed's native threads have aborted at interpreter exit here; the output is written.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
