"""scripts/bench/buffer_pages.py on tiny sizes: one line of rates per process, a rate per read of every set,
its files removed, bad arguments refused with the value named."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "bench", "buffer_pages.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_rate_per_read_of_every_set_in_every_process(tmp_path):
    completed = run("--folder", str(tmp_path), "--processes", "2", "--sets", "3", "--buffers", "2", "--mib", "1",
                    "--reads", "2")
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith("process ")]
    assert [line.split(":")[0] for line in lines] == ["process 1", "process 2"]
    for line in lines:
        sets = line.split(": ", 1)[1].split()
        assert len(sets) == 3
        assert all(re.fullmatch(r"\d+\.\d\d/\d+\.\d\d", rates) and float(rates.split("/")[0]) > 0 for rates in sets)
    assert "transparent huge pages:" in completed.stdout
    assert os.listdir(tmp_path) == []  # its files are gone


def test_bad_arguments_are_named(tmp_path):
    completed = run("--folder", str(tmp_path), "--sets", "0")
    assert completed.returncode == 2 and "--sets must be at least 1, got 0" in completed.stderr
