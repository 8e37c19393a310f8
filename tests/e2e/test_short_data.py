"""A data iterator that runs out in the middle of a step: an error naming gradient_accumulation_steps and
the micro-batches that arrived, and no trace of the failed step (the next good step is plain PyTorch's)."""
import itertools

import pytest

from ds_greedysnake.runtime.engine import ShortDataError
from greedysnake_run import make_engine
from helpers import fresh_model, reference_training, relative_l2, tiny_gpt_config

pytestmark = pytest.mark.slow
HIDDEN = 64


def test_a_short_iterator_names_the_counts_and_leaves_no_trace(tmp_path):
    engine, batches = make_engine(str(tmp_path / "nvme"), 4, hidden=HIDDEN)
    try:
        with pytest.raises(ShortDataError, match="ran out after 3 .*gradient_accumulation_steps is 4"):
            engine.train_batch(iter(list(itertools.islice(make_engine_data(), 3))))
        with pytest.raises(StopIteration, match="no micro-batch arrived"):
            engine.train_batch(iter([]))
        assert engine.global_steps == 0 and engine.global_samples == 0
        engine.train_batch(batches)  # the good step, on the same data as the reference
        reference, _ = reference_training(fresh_model(tiny_gpt_config(HIDDEN)), tiny_gpt_config(HIDDEN), 4, 1)
        assert relative_l2(engine.master_parameters(), reference) <= 1e-5
        assert engine.global_steps == 1
    finally:
        engine.close()


def make_engine_data():
    from helpers import data
    return data(tiny_gpt_config(HIDDEN))
