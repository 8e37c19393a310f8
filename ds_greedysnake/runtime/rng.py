"""Random-number state saved when a layer runs forward and replayed when it is recomputed for backward,
so dropout draws the same masks both times (as torch.utils.checkpoint's preserve_rng_state does)."""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
from deepspeed.accelerator import get_accelerator


@dataclass
class RngState:
    cpu: torch.Tensor
    accelerator: Optional[torch.Tensor]  # None on DeepSpeed's CPU accelerator: the CPU state is the one


def _accelerator():
    accelerator = get_accelerator()
    return None if accelerator.device_name() == "cpu" else accelerator


def capture_rng_state() -> RngState:
    accelerator = _accelerator()
    return RngState(torch.get_rng_state(), accelerator.get_rng_state() if accelerator is not None else None)


def _restore(state: RngState) -> None:
    torch.set_rng_state(state.cpu)
    if state.accelerator is not None:
        _accelerator().set_rng_state(state.accelerator)


@contextmanager
def replaying(state: Optional[RngState]):
    """Run the body with the random state ``state`` (None: as is), then put back the state from before,
    so the replay does not change the random numbers drawn afterwards."""
    if state is None:
        yield
        return
    current = capture_rng_state()
    _restore(state)
    try:
        yield
    finally:
        _restore(current)
