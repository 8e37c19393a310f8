"""scripts/bench/ssd_rates.py on small sizes: every size and transfer kind measured, its files removed, bad
arguments refused with the value named."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "bench", "ssd_rates.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_rates_by_size_and_in_flight(tmp_path):
    folder, out = tmp_path / "ssd", tmp_path / "rates.json"
    folder.mkdir()
    completed = run("--nvme-path", str(folder), "--sizes-mib", "1", "2.5", "--in-flight", "3", "--rounds", "2",
                    "--stream", "3", "--json", str(out))
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    result = json.loads(out.read_text())
    kinds = {(row["size_mib"], row["transfer"]) for row in result["rows"]}
    regions_by_kind = {"write": 1, "read": 1, "read, 3 in flight": 3, "read + write at once": 2,
                       "stream of 3, 1 in flight": 3, "stream of 3, 2 in flight": 3}
    assert kinds == {(size, kind) for size in (1, 2.5) for kind in regions_by_kind}
    for row in result["rows"]:
        assert len(row["seconds"]) == 2 and all(seconds > 0 for seconds in row["seconds"])
        assert row["mib_per_s_min"] <= row["mib_per_s_median"] <= row["mib_per_s_max"]
        regions = regions_by_kind[row["transfer"]]
        assert row["regions"] == regions
        assert row["mib_per_s_max"] == regions * row["size_mib"] / min(row["seconds"])
    assert "| 2.5 | read, 3 in flight |" in completed.stdout and "| 2.5 | stream of 3, 2 in flight |" in completed.stdout
    assert os.listdir(folder) == []  # its scratch folder is gone


def test_bad_arguments_are_named(tmp_path):
    missing = tmp_path / "nowhere"
    completed = run("--nvme-path", str(missing))
    assert completed.returncode == 2 and str(missing) in completed.stderr and "create it" in completed.stderr
    completed = run("--nvme-path", str(tmp_path), "--in-flight", "1")
    assert completed.returncode == 2 and "at least 2" in completed.stderr
    completed = run("--nvme-path", str(tmp_path), "--stream", "1")
    assert completed.returncode == 2 and "--stream must be at least 2 regions, got 1" in completed.stderr
    completed = run("--nvme-path", str(tmp_path), "--sizes-mib", "0")
    assert completed.returncode == 2 and "[0.0]" in completed.stderr
