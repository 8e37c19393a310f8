"""A micro-batch's way to the device (micro_batch.to_device): pinned and non-blocking off the CPU, the host
tensors kept beside the device ones for the layers' decisions (side_input_on_host)."""
import torch

from ds_greedysnake.models import micro_batch
from ds_greedysnake.models.micro_batch import DeviceInputs, running_on, side_input_on_host, side_inputs, to_device


class RecordingAccelerator:
    def __init__(self):
        self.pinned = []

    def pin_memory(self, tensor):
        self.pinned.append(tensor)
        return tensor


def test_to_another_device_each_tensor_is_pinned_and_copied_without_blocking(monkeypatch):
    accelerator = RecordingAccelerator()
    monkeypatch.setattr(micro_batch, "get_accelerator", lambda: accelerator)
    copies = []
    original_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        copies.append(kwargs.get("non_blocking", False))
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    ids, mask = torch.arange(6).view(2, 3), torch.ones(2, 3, dtype=torch.long)
    moved = to_device({"input_ids": ids, "attention_mask": mask, "max_length_q": 3}, torch.device("meta"))
    assert moved["input_ids"].device.type == "meta" and moved["attention_mask"].device.type == "meta"
    assert moved["max_length_q"] == 3
    assert [id(t) for t in accelerator.pinned] == [id(ids), id(mask)]
    assert copies == [True, True]  # a blocking copy from pageable memory waits for the device's queue
    assert isinstance(moved, DeviceInputs) and moved.on_host["attention_mask"] is mask


def test_on_the_cpu_nothing_is_copied_or_pinned(monkeypatch):
    accelerator = RecordingAccelerator()
    monkeypatch.setattr(micro_batch, "get_accelerator", lambda: accelerator)
    ids = torch.arange(6).view(2, 3)
    assert to_device(ids, torch.device("cpu")) is ids
    assert to_device({"input_ids": ids}, "cpu")["input_ids"] is ids
    assert accelerator.pinned == []


def test_layers_see_the_host_tensors_a_side_input_came_from():
    mask = torch.ones(2, 3, dtype=torch.long)
    on_device = DeviceInputs({"input_ids": torch.zeros(2, 3), "attention_mask": mask.clone()}, {"attention_mask": mask})
    with running_on(on_device):
        assert side_input_on_host("attention_mask") is mask
        assert side_inputs()["attention_mask"] is on_device["attention_mask"]
        assert "input_ids" not in side_inputs() and side_input_on_host("position_ids") is None
    with running_on({"input_ids": torch.zeros(2, 3), "attention_mask": mask}):  # given on the host: itself
        assert side_input_on_host("attention_mask") is mask
    with running_on(torch.zeros(2, 3)):
        assert side_input_on_host("attention_mask") is None
