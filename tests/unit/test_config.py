"""Every config error names the value it found and the fix."""
import copy

import pytest

from ds_greedysnake.config import (GreedySnakeConfig, GreedySnakeConfigError, check_ds_config, check_nvme_path,
                                   parse_greedysnake_config)
from helpers import ds_config


@pytest.fixture
def good(tmp_path):
    return ds_config(str(tmp_path), num_micro_batches=2)


def test_defaults_and_docstrings():
    config = parse_greedysnake_config({})
    assert config.enabled is False and config.prefetch is True
    for name in GreedySnakeConfig.model_fields:
        source = open(__import__("ds_greedysnake.config", fromlist=["x"]).__file__).read()
        assert f"    {name}:" in source
        # The docstring under each field: the line after the field starts with triple quotes.
        after = source.split(f"    {name}:", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), name


def test_unknown_key_is_named():
    with pytest.raises(GreedySnakeConfigError, match="enabeld.*Known keys: enabled"):
        parse_greedysnake_config({"greedysnake": {"enabeld": True}})


def test_wrong_type_is_named():
    with pytest.raises(GreedySnakeConfigError, match="activation_host_memory_mb"):
        parse_greedysnake_config({"greedysnake": {"activation_host_memory_mb": -1}})
    with pytest.raises(GreedySnakeConfigError, match="must be an object"):
        parse_greedysnake_config({"greedysnake": True})


def test_good_config_passes(good, tmp_path):
    assert check_ds_config(good, "cpu") == str(tmp_path)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["zero_optimization"].update(stage=2), "stage 3.*got stage 2"),
    (lambda c: c["zero_optimization"].pop("offload_param"), "offload_param.device \"nvme\", got 'none'"),
    (lambda c: c["zero_optimization"]["offload_optimizer"].update(device="cpu"),
     "offload_optimizer.device \"nvme\", got 'cpu'"),
    (lambda c: c["zero_optimization"]["offload_param"].pop("nvme_path"), "offload_param.nvme_path is missing"),
    (lambda c: c["zero_optimization"]["offload_optimizer"].update(nvme_path="/elsewhere"), "differ"),
    (lambda c: c.update(fp16={"enabled": True}), "fp16.enabled is true but the accelerator is the CPU"),
    (lambda c: c.update(optimizer={"type": "SGD"}), "AdamW.*got 'SGD'"),
])
def test_bad_ds_config(good, edit, message):
    config = copy.deepcopy(good)
    edit(config)
    with pytest.raises(GreedySnakeConfigError, match=message):
        check_ds_config(config, "cpu")


def test_missing_nvme_path(tmp_path):
    with pytest.raises(GreedySnakeConfigError, match="does not exist.*mkdir -p"):
        check_nvme_path(str(tmp_path / "nope"))


def test_nvme_path_that_is_a_file(tmp_path):
    file_path = tmp_path / "file"
    file_path.write_text("x")
    with pytest.raises(GreedySnakeConfigError, match="not a folder"):
        check_nvme_path(str(file_path))


def test_tmpfs_is_refused():
    import os
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm here")
    with pytest.raises(GreedySnakeConfigError, match="on tmpfs, which keeps every byte in RAM"):
        check_nvme_path("/dev/shm")


def test_filesystem_without_direct_io(tmp_path, monkeypatch):
    import errno
    import os
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    with pytest.raises(GreedySnakeConfigError, match="without direct I/O"):
        check_nvme_path(str(tmp_path))


def test_unwritable_path(tmp_path, monkeypatch):
    # Tests run as root, for whom permission bits do not bite; make the access check answer "no".
    import os
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(GreedySnakeConfigError, match="not writable"):
        check_nvme_path(str(tmp_path))


def test_worker_threads_default_depends_on_the_accelerator(monkeypatch):
    from ds_greedysnake.config import worker_threads_for
    default = parse_greedysnake_config({})
    assert worker_threads_for(default, "cpu") == 1  # training computes on the same cores
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(16)))
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert worker_threads_for(default, "cuda") == 6  # 8 cores per rank, one for training, one for aio
    monkeypatch.setenv("LOCAL_SIZE", "8")
    assert worker_threads_for(default, "cuda") == 1
    assert worker_threads_for(parse_greedysnake_config({"greedysnake": {"optimizer_worker_threads": 3}}), "cuda") == 3


def test_training_threads_are_the_cores_of_the_rank_less_the_workers(monkeypatch):
    from ds_greedysnake.config import training_threads_for
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(2)))
    monkeypatch.setenv("LOCAL_SIZE", "1")
    default = parse_greedysnake_config({})
    assert training_threads_for(default, "cpu") == 1  # 2 cores, one of them the worker's
    inline = parse_greedysnake_config({"greedysnake": {"optimizer_overlap": False}})
    assert training_threads_for(inline, "cpu") == 1  # the same threads, so the same bits, as with the overlap
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(16)))
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert training_threads_for(default, "cuda") == 2  # 8 cores per rank, 6 of them the worker's
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0})
    assert training_threads_for(default, "cuda") == 1  # never none
    assert training_threads_for(parse_greedysnake_config({"greedysnake": {"training_threads": 3}}), "cpu") == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert training_threads_for(default, "cpu") is None  # the user's choice stands
