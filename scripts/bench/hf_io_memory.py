"""Peak host memory of a Hugging Face model in and out of greedysnake, each step in its own process.

    nice -n 10 python scripts/bench/hf_io_memory.py --workdir /path/on/ssd/hf_io      # Llama, 645 M parameters (2.6 GB fp32)

1. make:   a random Llama saved by HF (safetensors shards) -- plain transformers, the whole model in RAM;
2. load:   ds_greedysnake.from_pretrained(folder): the weights stream into the SSD regions;
           then engine.save_pretrained(out) and engine.save_checkpoint(ckpt), each peak measured apart;
3. export: python -m ds_greedysnake.export (the checkpoint to an HF folder), in a fresh process;
4. verify: every tensor of both exports equals the original, read one tensor at a time.
Peak RSS is VmHWM (reset before each measured call), of the process and of its optimizer worker.
The ds_config keeps no optimizer state or gradient in host memory (the budgets at 0): everything on SSD.
One JSON line per step; the last one sums it up against the bound (a quarter of the model + 2 GiB).
"""
import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "scripts")  # train_hf.py
sys.path[:0] = [SCRIPTS, REPO]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                   ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
    os.environ.setdefault(key, value)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a folder on the SSD (needs about 40 GB free)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size", default="500MB", help="max_shard_size of every save")
    parser.add_argument("--step", choices=("all", "make", "load", "export", "verify"), default="all")
    return parser.parse_args()


def peak_gib(pid="self") -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def reset_peak(pid="self") -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as handle:
        handle.write("5")


def children():
    from train_hf import _children
    return _children()


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def paths(args):
    return {name: os.path.join(args.workdir, name) for name in ("pretrained", "nvme", "out", "checkpoints", "cli")}


def make(args) -> None:
    import torch
    import transformers
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      num_attention_heads=16, num_key_value_heads=16,
                                      intermediate_size=256 * ((8 * args.hidden // 3 + 255) // 256),
                                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(paths(args)["pretrained"], max_shard_size=args.shard_size)
    report(step="make", parameters=sum(p.numel() for p in model.parameters()),
           weight_bytes=sum(p.numel() * 4 for p in model.parameters()))


def ds_config(nvme: str) -> dict:
    with open(os.path.join(REPO, "configs", "greedysnake_hf.json")) as handle:
        config = json.load(handle)
    config.pop("bf16", None)  # fp32: the exports must equal the original bit for bit
    for section in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][section]["nvme_path"] = nvme
    config["gradient_accumulation_steps"] = 1
    config["greedysnake"].update(optimizer_host_memory_mb=0, gradient_host_memory_mb=0, activation_host_memory_mb=64)
    return config


def load(args) -> None:
    import ds_greedysnake
    where = paths(args)
    os.makedirs(where["nvme"], exist_ok=True)
    started = time.perf_counter()
    engine, _, _, _ = ds_greedysnake.from_pretrained(where["pretrained"], config=ds_config(where["nvme"]))
    loaded = {"process_gib": peak_gib(), "children_gib": [peak_gib(pid) for pid in children()],
              "seconds": round(time.perf_counter() - started, 1)}
    measured = {}
    for name, action in (("save_pretrained", lambda: engine.save_pretrained(where["out"], args.shard_size)),
                         ("save_checkpoint", lambda: engine.save_checkpoint(where["checkpoints"], tag="loaded"))):
        for pid in ["self"] + children():
            reset_peak(pid)
        started = time.perf_counter()
        action()
        measured[name] = {"process_gib": peak_gib(), "children_gib": [peak_gib(pid) for pid in children()],
                          "seconds": round(time.perf_counter() - started, 1)}
    engine.close()
    report(step="load", load=loaded, **measured)


def export(args) -> None:
    from ds_greedysnake.models.export import main as export_main
    where = paths(args)
    started = time.perf_counter()
    export_main(["--checkpoint", where["checkpoints"], "--tag", "loaded", "--model-config", where["pretrained"],
                 "--out", where["cli"], "--max-shard-size", args.shard_size])
    report(step="export", process_gib=peak_gib(), seconds=round(time.perf_counter() - started, 1))


def verify(args) -> None:
    from safetensors import safe_open
    import torch
    where = paths(args)

    def tensors(folder):
        index = os.path.join(folder, "model.safetensors.index.json")
        with open(index) as handle:
            return json.load(handle)["weight_map"]

    original = tensors(where["pretrained"])
    checked = 0
    for folder in (where["out"], where["cli"]):
        exported = tensors(folder)
        assert set(exported) == set(original), (folder, sorted(set(exported) ^ set(original))[:5])
        for key, name in original.items():
            with safe_open(os.path.join(where["pretrained"], name), framework="pt") as first, \
                    safe_open(os.path.join(folder, exported[key]), framework="pt") as second:
                assert torch.equal(first.get_tensor(key), second.get_tensor(key)), (folder, key)
            checked += 1
    report(step="verify", tensors_equal=checked)


def main():
    args = parse_args()
    if args.step != "all":
        {"make": make, "load": load, "export": export, "verify": verify}[args.step](args)
        return
    results = {}
    for step in ("make", "load", "export", "verify"):
        done = subprocess.run([sys.executable, __file__, "--workdir", args.workdir, "--hidden", str(args.hidden),
                               "--layers", str(args.layers), "--vocab", str(args.vocab), "--shard-size",
                               args.shard_size, "--step", step], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"step {step} failed:\n{done.stderr[-4000:]}")
        results[step] = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(results[step]), flush=True)
    model_gib = results["make"]["weight_bytes"] / 2**30
    bound = model_gib / 4 + 2
    peaks = {"load": results["load"]["load"]["process_gib"],
             "save_pretrained": results["load"]["save_pretrained"]["process_gib"],
             "export_cli": results["export"]["process_gib"]}
    report(step="summary", model_gib=round(model_gib, 3), bound_gib=round(bound, 3),
           peaks_gib={k: round(v, 3) for k, v in peaks.items()}, all_under_bound=all(v < bound for v in peaks.values()))


if __name__ == "__main__":
    main()
