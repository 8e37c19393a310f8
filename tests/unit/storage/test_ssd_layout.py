"""The SSD layout: one slot for layers never updated speculatively, the gradient in their parameter file,
host slots as host_memory.py assigns them, and the disk check that names the bytes needed and free."""
import collections

import pytest

from ds_greedysnake.storage import ssd_layout
from ds_greedysnake.storage.ssd_layout import (LayoutSettings, SsdSpaceError, activation_spill_bytes, check_free_space,
                                               padded_size, plan_layout)

PIECE = 1 << 22


def settings(post_decision, compute=2, gradient=4, gradient_host=0, optimizer_host=0, **options):
    return LayoutSettings(compute, gradient, post_decision, gradient_host, optimizer_host, PIECE, **options)


def test_post_decision_layers_get_one_slot_and_their_gradient_in_the_parameter_file():
    numels = [10_000, 20_000, 30_000, 40_000]
    layout = plan_layout(numels, settings(post_decision=2))
    assert [layer.param_slots for layer in layout.layers] == [1, 1, 2, 2]
    assert [layer.state_slots for layer in layout.layers] == [1, 1, 2, 2]
    assert [layer.gradient_in_parameter_file for layer in layout.layers] == [True, True, False, False]
    first, last = layout.layers[0], layout.layers[-1]
    # bf16 weights (2 B) and an fp32 gradient (4 B) share one file of the larger size.
    assert first.parameter_file_bytes == padded_size(4 * 10_000)
    assert first.bytes_by_kind() == {"parameters": padded_size(20_000), "frozen parameters": 0,
                                     "optimizer states": padded_size(120_000),
                                     "gradients": padded_size(40_000) - padded_size(20_000)}
    assert last.bytes_by_kind() == {"parameters": 2 * padded_size(80_000), "frozen parameters": 0,
                                    "optimizer states": 2 * padded_size(480_000),
                                    "gradients": padded_size(160_000)}
    total = layout.bytes_by_kind(activation_spill_bytes=12_288)
    assert total["activation spill"] == 12_288
    assert sum(total.values()) == 12_288 + sum(sum(layer.bytes_by_kind().values()) for layer in layout.layers)


def test_bytes_per_parameter_of_each_configuration():
    """Per parameter, padding aside: 16 B for a one-slot layer (bf16 weights and fp32 gradient share 4 B,
    12 B of states), 14 B with bf16 accumulation, 16 B in fp32; a speculative layer 32 B (bf16)."""
    numel = 1 << 24  # four pieces of states

    def per_parameter(**options):
        layout = plan_layout([numel], settings(**options))
        return sum(layout.bytes_by_kind().values()) / numel

    assert per_parameter(post_decision=1) == pytest.approx(16, abs=5e-3)
    assert per_parameter(post_decision=1, gradient=2) == pytest.approx(14, abs=5e-3)
    assert per_parameter(post_decision=1, compute=4) == pytest.approx(16, abs=5e-3)
    assert per_parameter(post_decision=0) == pytest.approx(32, abs=5e-3)
    assert per_parameter(post_decision=0, compute=4) == pytest.approx(36, abs=5e-3)
    # The two-slot engine as it was, forced: 32 B even where one slot would do.
    assert per_parameter(post_decision=1, in_place_layers=0) == pytest.approx(32, abs=5e-3)
    # Gradient in host memory: weights and states only.
    assert per_parameter(post_decision=1, gradient_host=1 << 30) == pytest.approx(14, abs=5e-3)


def test_host_slots_match_the_host_arenas():
    numels = [1000] * 4
    layout = plan_layout(numels, settings(post_decision=2, gradient_host=2 * 4096, optimizer_host=12 * 4096))
    # Gradients from the last layer down while they fit; states from layer 0 up among the post-decision ones.
    assert [layer.gradient_on_ssd for layer in layout.layers] == [True, True, False, False]
    assert [layer.state_slots for layer in layout.layers] == [0, 0, 2, 2]
    assert ssd_layout.host_slot_offsets(range(4), numels, 12, 12 * 4096) == {0: 0, 1: 12_288, 2: 24_576, 3: 36_864}


def test_activation_spill():
    # 3 layer inputs x 4 micro-batches of 10,000 bytes; 25,000 bytes of host memory hold two.
    assert activation_spill_bytes(3, 4, 10_000, 25_000) == 10 * padded_size(10_000)
    assert activation_spill_bytes(3, 4, 10_000, 1e12) == 0


def test_a_disk_too_small_is_named_with_needed_and_free(monkeypatch, tmp_path):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(ssd_layout.shutil, "disk_usage", lambda path: usage(10_000_000, 9_000_000, 1_000_000))
    assert check_free_space(999_999, str(tmp_path), "everything") == 1_000_000
    with pytest.raises(SsdSpaceError, match=r"everything need 1,000,001 bytes .* and 1,000,000 bytes .* are free"):
        check_free_space(1_000_001, str(tmp_path), "everything")


@pytest.mark.parametrize("post_decision", [0, 2, 3])
def test_frozen_parameters_get_one_read_only_region_and_nothing_else(post_decision):
    """A layer's frozen elements: one region of the compute dtype, never a second slot, state or gradient;
    a layer with nothing to train has no slot, no host slot and no gradient at all."""
    trainable = [0, 5_000, 0]
    frozen = [40_000, 100_000, 30_000]
    layout = plan_layout(trainable, settings(post_decision=post_decision, gradient_host=1 << 30,
                                             optimizer_host=1 << 30), frozen)
    for placed, numel, frozen_numel in zip(layout.layers, trainable, frozen):
        kinds = placed.bytes_by_kind()
        assert kinds["frozen parameters"] == padded_size(2 * frozen_numel)
        assert placed.trainable == bool(numel)
        if not numel:
            assert (placed.param_slots, placed.state_slots, placed.gradient_on_ssd) == (0, 0, False)
            assert kinds == {"parameters": 0, "frozen parameters": padded_size(2 * frozen_numel),
                             "optimizer states": 0, "gradients": 0}
    # The host budgets go to the layer that trains, whatever the order they are handed out in.
    assert ssd_layout.host_slot_offsets(range(3), trainable, 12, 1 << 30) == {1: 0}
    assert ssd_layout.host_slot_offsets(reversed(range(3)), trainable, 4, 1 << 30) == {1: 0}
    total = layout.bytes_by_kind()
    assert total["frozen parameters"] == sum(padded_size(2 * numel) for numel in frozen)
