"""The shared host arenas: gradients handed to the optimizer worker, and front layers' optimizer states."""
import subprocess
import sys

import torch

from ds_greedysnake.storage.host_memory import HostArena
from ds_greedysnake.storage.ssd import ALIGNMENT


def test_slots_go_to_the_last_layers_while_they_fit():
    numels = [1000, 5000, 3000, 2000]
    # Room for the last two layers (2000 and 3000 floats, each rounded up to 4096-byte pages) only.
    budget = 2 * ALIGNMENT + 3 * ALIGNMENT + 100
    arena = HostArena.for_gradients(numels, budget)
    assert sorted(arena.slot_offsets) == [2, 3]
    assert arena.total_bytes <= budget
    arena.slot(3, 2000).fill_(1.0)
    arena.slot(2, 3000).fill_(2.0)
    assert float(arena.slot(3, 2000).sum()) == 2000.0, "slots must not overlap"
    arena.close()


def test_zero_budget_means_no_arena():
    arena = HostArena.for_gradients([10, 10], 0)
    assert not arena.holds(0) and not arena.holds(1) and arena.fd is None
    arena.close()


def test_state_slots_go_to_the_front_eligible_layers_while_they_fit():
    numels = [1000, 2000, 3000, 4000]
    # 12 bytes per parameter: layer 0 takes 3 pages, layer 1 six; layer 2 would need nine more.
    budget = (3 + 6 + 8) * ALIGNMENT
    arena = HostArena.for_optimizer_states(numels, eligible_layers=4, budget_bytes=budget)
    assert sorted(arena.slot_offsets) == [0, 1]
    arena.slot(0, 3 * 1000).fill_(1.0)
    arena.slot(1, 3 * 2000).fill_(2.0)
    assert float(arena.slot(0, 3 * 1000).sum()) == 3000.0, "slots must not overlap"
    arena.close()
    # Only layers updated after the decision are eligible, however large the budget.
    only_front = HostArena.for_optimizer_states(numels, eligible_layers=1, budget_bytes=1 << 30)
    assert sorted(only_front.slot_offsets) == [0]
    only_front.close()
    # The first layer that does not fit ends the run: no later, smaller layer is taken instead.
    big_front = HostArena.for_optimizer_states([4000, 10], eligible_layers=2, budget_bytes=ALIGNMENT)
    assert big_front.slot_offsets == {} and big_front.fd is None
    big_front.close()


def test_another_process_sees_the_gradient():
    arena = HostArena.for_gradients([4096], 1 << 20)
    arena.slot(0, 4096).copy_(torch.arange(4096, dtype=torch.float32))
    reader = ("import sys, torch; sys.path.insert(0, sys.argv[1]); "
              "from ds_greedysnake.storage.host_memory import HostArena; "
              "arena = HostArena.attach({0: 0}, int(sys.argv[2]), int(sys.argv[3])); "
              "print(float(arena.slot(0, 4096).sum()))")
    import os
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    output = subprocess.run([sys.executable, "-c", reader, repo, str(arena.total_bytes), str(arena.fd)],
                            pass_fds=(arena.fd,), capture_output=True, text=True, check=True).stdout
    assert float(output) == float(sum(range(4096)))
    arena.close()


def test_squared_norm_is_accurate():
    from ds_greedysnake.runtime.optimizer import squared_norm

    torch.manual_seed(0)
    for numel in (1, 1023, 1024, 3 * 1024 + 17, 2_000_003):
        values = torch.randn(numel) * 3
        exact = float(values.double().pow(2).sum())
        assert abs(squared_norm(values) - exact) <= 3e-7 * exact
    assert squared_norm(torch.tensor([float("inf"), 1.0])) == float("inf")
    assert squared_norm(torch.tensor([float("nan")] * 2048)) != squared_norm(torch.tensor([float("nan")] * 2048))


def test_the_gradient_arena_is_registered_for_device_copies_and_unregistered_at_close(monkeypatch):
    from ds_greedysnake.storage import transfers
    calls = []

    class RegisteringAccelerator:
        def device_name(self):
            return "cuda"

        def register_host_memory(self, address, num_bytes):
            calls.append(("register", address, num_bytes))
            return True

        def unregister_host_memory(self, address):
            calls.append(("unregister", address))

    monkeypatch.setattr(transfers, "get_accelerator", lambda: RegisteringAccelerator())
    arena = HostArena.for_gradients([1000, 3000], 1 << 20)
    address = arena.slot(1, 3000).data_ptr() - arena.slot_offsets[1]
    assert calls == [("register", address, arena.total_bytes)]
    arena.close()
    assert calls[-1] == ("unregister", address)
