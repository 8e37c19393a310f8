"""The planner's SSD probe on tiny transfers: its mechanics (every rate measured, positive, its files
removed), not the rates themselves, which a loaded machine moves."""
import os

from ds_greedysnake.deepspeed_compat import AioSettings
from ds_greedysnake.planner.probe import probe_ssd

RATE_KEYS = ("ssd_read_bytes_per_s", "ssd_write_bytes_per_s", "ssd_read_bytes_per_s_single",
             "ssd_write_bytes_per_s_single")


def test_ssd_probe_on_tiny_transfers(tmp_path):
    folder = tmp_path / "ssd"
    rates = probe_ssd(str(folder), AioSettings(), region_mib=1, repeats=1)
    assert set(rates) == set(RATE_KEYS) | {"ssd_read_seconds_per_transfer", "ssd_write_seconds_per_transfer"}
    assert all(rates[key] > 0 for key in RATE_KEYS), rates
    assert rates["ssd_read_seconds_per_transfer"] >= 0 and rates["ssd_write_seconds_per_transfer"] >= 0
    assert os.listdir(folder) == []  # its scratch folder is gone
