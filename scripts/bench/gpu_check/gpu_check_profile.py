"""How much of each layer's host-to-device copy ran under compute, from a torch.profiler chrome trace.

A copy counts as hidden for the time it overlaps any compute kernel (of any stream); its layer is found
by matching its size to the layers' parameter bytes in the order the step fetches them. Used by
scripts/bench/gpu_check/gpu_check.py; a pure function of the trace, so that it is tested without a GPU.
"""
from typing import Dict, List, Optional, Sequence, Tuple

Interval = Tuple[float, float]


def _union(intervals: List[Interval]) -> List[Interval]:
    merged: List[Interval] = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def _overlap(interval: Interval, merged: List[Interval]) -> float:
    start, stop = interval
    return sum(max(0.0, min(stop, b) - max(start, a)) for a, b in merged if a < stop and b > start)


def host_to_device_copies(trace: Dict) -> List[Dict]:
    """Every host-to-device memcpy of the trace, in time order: start and duration (us), bytes, stream."""
    copies = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") == "gpu_memcpy" and "HtoD" in event.get("name", ""):
            args = event.get("args", {})
            copies.append({"start_us": float(event["ts"]), "duration_us": float(event.get("dur", 0.0)),
                           "bytes": int(args.get("bytes", 0)), "stream": args.get("stream")})
    return sorted(copies, key=lambda copy: copy["start_us"])


def compute_intervals(trace: Dict) -> List[Interval]:
    return _union([(float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0)))
                   for event in trace.get("traceEvents", [])
                   if event.get("ph") == "X" and event.get("cat") == "kernel"])


def layer_copy_overlap(trace: Dict, fetch_sequence: Sequence[Tuple[int, int]]) -> Dict:
    """Per parameter copy (matched to ``fetch_sequence``: (layer, bytes) in fetch order), the share of its
    time under compute; and the share over all of them, weighted by time."""
    kernels = compute_intervals(trace)
    position, layers = 0, []
    for copy in host_to_device_copies(trace):
        if position >= len(fetch_sequence):
            break
        layer, num_bytes = fetch_sequence[position]
        if copy["bytes"] != num_bytes:
            continue  # an activation or gradient coming back, or a small tensor
        hidden = _overlap((copy["start_us"], copy["start_us"] + copy["duration_us"]), kernels)
        layers.append(dict(copy, layer=layer, fetch=position, hidden_us=hidden,
                           hidden_share=hidden / copy["duration_us"] if copy["duration_us"] > 0 else None))
        position += 1
    total = sum(item["duration_us"] for item in layers)
    hidden_share: Optional[float] = sum(item["hidden_us"] for item in layers) / total if total > 0 else None
    return {"copies": layers, "copy_us": total, "hidden_share": hidden_share, "fetches_expected": len(fetch_sequence),
            "fetches_matched": len(layers), "kernels": len(kernels)}
