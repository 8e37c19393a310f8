"""SSD bytes for a model not built: the plan CLI's report, a model split as the engine splits it (tied
embeddings counted once), and ZeRO-Infinity's swap rules."""
import json
import os

from torch import nn

from ds_greedysnake.planner import cli as plan_cli
from ds_greedysnake.planner.shapes import named_shape
from ds_greedysnake.planner.ssd_space import model_ssd_bytes, ssd_bytes, zero_infinity_ssd_bytes
from ds_greedysnake.storage.ssd_layout import padded_size
from ds_greedysnake.settings import settings_from_ds_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
A100 = os.path.join(REPO, "configs", "hardware", "a100_pcie4.json")
CONFIG = os.path.join(REPO, "configs", "greedysnake_gpt_small.json")


def test_the_plan_reports_the_ssd_bytes_of_its_recommended_block(capsys):
    assert plan_cli.main(["--config", CONFIG, "--hardware", A100, "--model", "gpt-small", "--host-memory", "8",
                          "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    with open(CONFIG) as handle:
        config = json.load(handle)
    shape = named_shape("gpt-small")
    recommended = report["recommended"]
    checkpoint_bytes = (config["train_micro_batch_size_per_gpu"] * shape.seq_len * shape.hidden
                        * (2 if (config.get("bf16") or {}).get("enabled") else 4))
    expected = ssd_bytes([layer.params for layer in shape.layers], settings_from_ds_config(config),
                         recommended["micro_batches"], checkpoint_bytes, recommended["greedysnake_block"])
    assert report["ssd_bytes"] == expected and expected["parameters"] > 0
    assert plan_cli.main(["--config", CONFIG, "--hardware", A100, "--model", "gpt-small", "--host-memory", "8"]) == 0
    assert "SSD space (the recommended block" in capsys.readouterr().out


def test_clipping_gives_one_slot_per_layer():
    numels = [1 << 20] * 4
    base = {"bf16": {"enabled": True}, "greedysnake": {"gradient_host_memory_mb": 0, "optimizer_host_memory_mb": 0}}
    clipped = ssd_bytes(numels, settings_from_ds_config(dict(base, gradient_clipping=1.0)), 1, 0)
    unclipped = ssd_bytes(numels, settings_from_ds_config(dict(base, gradient_clipping=0.0)), 1, 0)
    # One deferred layer of four without clipping: three keep a second parameter and state slot.
    assert clipped["parameters"] == 4 * padded_size(2 << 20)
    assert unclipped["parameters"] == (1 + 2 * 3) * padded_size(2 << 20)
    assert unclipped["optimizer states"] - clipped["optimizer states"] == 3 * padded_size(12 << 20)
    # DeepSpeed 0.19.8 clips when gradient_clipping is absent.
    assert ssd_bytes(numels, settings_from_ds_config(base), 1, 0) == clipped


def test_a_tied_output_layer_borrows_its_weight_from_layer_0():
    embedding, body, head = nn.Embedding(100, 8), nn.Linear(8, 8), nn.Linear(8, 100, bias=False)
    head.weight = embedding.weight
    model = nn.Sequential(embedding, body, nn.Sequential(nn.LayerNorm(8), head))
    config = settings_from_ds_config({"greedysnake": {"gradient_host_memory_mb": 0, "optimizer_host_memory_mb": 0}})
    assert model_ssd_bytes(model, config, 1, 0) == ssd_bytes([800, 72, 16], config, 1, 0)


def test_zero_infinity_keeps_small_tensors_in_memory():
    # bf16: a 1 Mi-element matrix is 2 MiB (swapped), a 256 Ki-element one 0.5 MiB (kept); in fp32 both swap
    # their optimizer states; a 1000-element bias stays whole.
    need = zero_infinity_ssd_bytes([1 << 20, 1 << 18, 1000], bf16=True, sub_group_size=1)
    assert need == {"parameters": 2 << 20, "optimizer states": 12 * (1 << 20) + 12 * (1 << 18),
                    "gradients": 4 * ((1 << 20) + (1 << 18)), "activation spill": 0}
    # One sub-group holds everything: it swaps whole.
    whole = zero_infinity_ssd_bytes([1 << 20, 1 << 18, 1000], bf16=True, sub_group_size=10**9)
    assert whole["optimizer states"] == 12 * ((1 << 20) + (1 << 18) + 1000)
