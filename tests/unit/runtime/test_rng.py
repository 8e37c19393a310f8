"""The random-state replay used for dropout in the backward recompute."""
import torch

from ds_greedysnake.runtime.rng import capture_rng_state, replaying


def test_replay_draws_the_same_mask_and_leaves_later_draws_alone():
    torch.manual_seed(0)
    dropout = torch.nn.Dropout(0.5)
    inputs = torch.ones(64)
    state = capture_rng_state()
    first = dropout(inputs)
    following = torch.rand(4)
    torch.manual_seed(0)
    dropout(inputs)
    with replaying(state):
        again = dropout(inputs)
    assert torch.equal(first, again)
    assert torch.equal(torch.rand(4), following)  # the replay put the state back


def test_no_state_is_a_no_op():
    torch.manual_seed(1)
    with replaying(None):
        drawn = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(torch.rand(3), drawn)
