import pytest
import torch
from torch import nn

from ds_greedysnake.models.model_split import ModelSplitError, plan_split, split_model
from ds_greedysnake.models.gpt import GPTConfig, build_gpt


def test_sequential_splits_into_its_children():
    model = build_gpt(GPTConfig(num_layers=2, hidden=32, vocab_size=64, seq_len=8))
    assert len(split_model(model)) == 4


def test_greedysnake_layers_method():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = build_gpt(GPTConfig(num_layers=1, hidden=32, vocab_size=64, seq_len=8))

        def greedysnake_layers(self):
            return list(self.inner)

    assert len(split_model(Wrapped())) == 3


def test_plain_module_is_refused_with_what_is_needed():
    with pytest.raises(ModelSplitError, match="cannot split Linear.*greedysnake_layers"):
        split_model(nn.Linear(2, 2))


def test_one_layer_is_not_enough():
    with pytest.raises(ModelSplitError, match="1 layer"):
        split_model(nn.Sequential(nn.Linear(2, 2)))


def test_ties_other_than_head_borrowing_from_layer_0_are_refused():
    embed, middle = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    middle.weight = embed.weight
    with pytest.raises(ModelSplitError, match="shared by layers 0 and 1.*untie"):
        split_model(nn.Sequential(embed, middle, nn.Linear(10, 2)))


def test_head_made_only_of_borrowed_parameters_is_refused():
    embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    with pytest.raises(ModelSplitError, match="only borrowed parameters"):
        split_model(nn.Sequential(embed, head))


def test_head_borrowing_the_embedding_is_recorded_as_a_tie():
    embed, head = nn.Embedding(10, 4), nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 10, bias=False))
    head[1].weight = embed.weight
    split = plan_split(nn.Sequential(embed, nn.Linear(4, 4), head))
    assert len(split.ties) == 1
    tie = split.ties[0]
    assert (tie.borrower, tie.lender, tie.names) == (2, 0, ("weight",))
    assert split.borrowed_by(2) == [embed.weight] and split.borrowed_by(1) == []
    assert split.lenders_of(2) == [0]


def test_parameters_outside_layers_are_refused():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
            self.scale = nn.Parameter(torch.ones(1))

        def greedysnake_layers(self):
            return list(self.blocks)

    with pytest.raises(ModelSplitError, match=r"\['scale'\].*belong to no layer"):
        split_model(Leaky())


def test_non_module_layer_is_refused():
    class Odd(nn.Module):
        def greedysnake_layers(self):
            return [nn.Linear(2, 2), "head"]

    with pytest.raises(ModelSplitError, match="layer 1.*str"):
        split_model(Odd())
