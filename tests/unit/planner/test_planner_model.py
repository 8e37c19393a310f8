"""The planner's cost model: shapes, per-phase lanes, both engines' traffic in M, and the LP."""
import itertools

import pytest

from ds_greedysnake.planner.cost_model import Linear, Workload, evaluate, ideal_vertical_phases, on_ssd
from ds_greedysnake.planner.zero_model import HorizontalSettings, horizontal_phases
from ds_greedysnake.planner.engine_model import EngineSettings, engine_phases
from ds_greedysnake.planner.errors import PlannerError
from ds_greedysnake.planner.hardware import Hardware, LayerTimes
from ds_greedysnake.planner.search import (BudgetTooSmall, best_plan_for, host_bytes, search, solve_placement)
from ds_greedysnake.planner.shapes import GPTShape, named_shape
from ds_greedysnake.settings import settings_from_ds_config

MIB = 2**20


def machine(**overrides) -> Hardware:
    values = dict(name="test", source="unit test", ssd_read_bytes_per_s=1000 * MIB, ssd_write_bytes_per_s=1000 * MIB,
                  ssd_read_bytes_per_s_single=500 * MIB, adam_elements_per_s=2e9, device_flops_per_s=1e11)
    values.update(overrides)
    return Hardware(**values)


def test_linear_arithmetic():
    x = Linear(2.0, {"act": 1.0}) + Linear(1.0, {"act": 2.0, "opt": -1.0}) * 2
    assert x.const == 4.0 and x.coefs == {"act": 5.0, "opt": -2.0}
    assert x.value({"act": 0.5, "opt": 1.0}) == pytest.approx(4.5)
    assert on_ssd("param", 10).value({"param": 0.3}) == pytest.approx(7.0)


@pytest.mark.parametrize("name", ["gpt-small", "ab-ssd-bound", "ab-compute-bound"])
def test_shape_parameters_match_the_built_model(name):
    from ds_greedysnake.models.gpt import GPTConfig, build_gpt
    shape = named_shape(name)
    model = build_gpt(GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq_len, hidden=shape.hidden,
                                num_heads=shape.heads, num_layers=shape.num_blocks))
    assert [sum(p.numel() for p in layer.parameters()) for layer in model] == [l.params for l in shape.layers]


def test_paper_shapes():
    assert named_shape("gpt-65b").params == pytest.approx(65e9, rel=0.02)
    assert named_shape("GPT-175B").params == pytest.approx(175e9, rel=0.02)


def test_vertical_parameter_traffic_is_flat_in_m_and_horizontal_grows():
    """SSD-bound on purpose (slow SSD, fast compute): greedysnake's step barely moves with M,
    ZeRO-Infinity's grows about linearly (a parameter read per micro-batch)."""
    hardware = machine(device_flops_per_s=1e15)
    shape = named_shape("ab-ssd-bound")
    times = {}
    for m in (1, 8):
        workload = Workload(shape, 1, m)
        times[m] = (evaluate("gs", engine_phases(workload, hardware, 1), workload, {}).seconds,
                    evaluate("zi", horizontal_phases(workload, hardware, HorizontalSettings()), workload, {}).seconds)
    assert times[8][0] < 1.05 * times[1][0]
    # Each further micro-batch reads every swapped tensor again: blocks three times (forward,
    # recompute, backward), the embedding and the head twice, one read in flight.
    per_micro_batch = sum((3 if layer.checkpointed else 2) * 4 * layer.swapped_params for layer in shape.layers)
    assert (times[8][1] - times[1][1]) / 7 == pytest.approx(per_micro_batch / (500 * MIB), rel=0.01)


def test_compute_bound_step_is_compute():
    hardware = machine(device_flops_per_s=1e8, ssd_read_bytes_per_s=1e12, ssd_write_bytes_per_s=1e12,
                       ssd_read_bytes_per_s_single=1e12, adam_elements_per_s=1e13)
    workload = Workload(named_shape("gpt-small"), 4, 8)
    prediction = evaluate("gs", engine_phases(workload, hardware, 1), workload, {})
    assert prediction.binding == "compute"
    tokens = workload.tokens_per_step
    flops = sum(layer.forward_flops_per_token for layer in workload.shape.layers) * tokens
    # Forward once without the last layer, recompute + backward (3x forward) for every layer.
    last = workload.shape.layers[-1].forward_flops_per_token * tokens
    assert prediction.seconds == pytest.approx((flops - last + 3 * flops) / 1e8, rel=0.01)


def test_first_forward_waits_for_the_front_update_and_reads_serially():
    hardware = machine()
    workload = Workload(named_shape("ab-ssd-bound"), 1, 2)
    phases = engine_phases(workload, hardware, deferred_layers=1)
    embedding = workload.shape.layers[0].params
    # The engine's transfers are deep-queued: reads at the deep rate (1000 MiB/s), not the one-op one.
    update = 16 * embedding / (1000 * MIB) + embedding / 2e9 + 16 * embedding / (1000 * MIB)
    read = 4 * embedding / (1000 * MIB)
    assert phases[0].name == "forward[0]"
    assert phases[0].serial.value({}) == pytest.approx(update + read)
    # Without overlap every update is one serial phase after backward.
    serial = engine_phases(workload, hardware, deferred_layers=1, overlap=False)
    assert serial[-1].name == "optimizer" and serial[-1].lanes == {}


def test_measured_layer_times_are_used_only_for_their_workload():
    workload = Workload(named_shape("ab-ssd-bound"), 1, 1)
    times = {kind: LayerTimes(1.0, 3.0) for kind in ("embedding", "block", "head")}
    matching = machine(layer_times=times, layer_times_for=workload.compute_key())
    other = machine(layer_times=times, layer_times_for="hidden=1")
    slow = evaluate("gs", engine_phases(workload, matching, 1), workload, {}).seconds
    fast = evaluate("gs", engine_phases(workload, other, 1), workload, {}).seconds
    assert slow > 10 > fast


def test_more_in_host_memory_is_never_slower():
    hardware = machine()
    workload = Workload(named_shape("ab-ssd-bound"), 1, 4)
    for phases in (engine_phases(workload, hardware, 1), ideal_vertical_phases(workload, hardware, 0.25)):
        previous = None
        for share in (0.0, 0.5, 1.0):
            seconds = evaluate("gs", phases, workload, dict.fromkeys(("act", "param", "opt", "grad"), share)).seconds
            assert previous is None or seconds <= previous + 1e-12
            previous = seconds


def test_lp_matches_a_grid_search():
    """The LP's optimum is no worse than any point of a grid over the three shares that fits the budget."""
    hardware = machine()
    workload = Workload(named_shape("ab-ssd-bound"), 1, 8)
    phases = ideal_vertical_phases(workload, hardware, 0.25)
    memory = host_bytes(workload)
    budget = memory.const + 0.3 * (memory.value(dict.fromkeys(("act", "param", "opt", "grad"), 1)) - memory.const)
    shares = solve_placement(phases, memory, budget, ("act", "param", "opt", "grad"))
    assert memory.value(shares) <= budget * (1 + 1e-6)
    best_lp = evaluate("gs", phases, workload, shares).seconds
    names = ("act", "param", "opt", "grad")
    grid = [i / 6 for i in range(7)]
    feasible = [dict(zip(names, point)) for point in itertools.product(grid, repeat=4)
                if memory.value(dict(zip(names, point))) <= budget]
    best_grid = min(evaluate("gs", phases, workload, point).seconds for point in feasible)
    assert best_lp <= best_grid + 1e-9


def test_engine_plans_keep_parameters_and_states_on_ssd():
    plan = best_plan_for(Workload(named_shape("ab-ssd-bound"), 1, 4), machine(), 64 * 2**30, HorizontalSettings())
    assert plan.shares["param"] == 0 and plan.shares["opt"] == 0 and plan.shares["act"] == 1
    block = plan.greedysnake_block()
    assert block["enabled"] and block["deferred_layers"] == plan.deferred_layers
    checkpoint_mib = 4 * 9 * 8 * 512 * 4 / MIB  # M x (L-1) layer inputs x tokens x hidden x fp32
    assert block["activation_host_memory_mb"] == pytest.approx(checkpoint_mib, abs=1)
    modelled = best_plan_for(Workload(named_shape("ab-ssd-bound"), 1, 4), machine(), 64 * 2**30,
                             HorizontalSettings(), modelled_shares=True)
    assert modelled.shares["opt"] == 1 and modelled.prediction.seconds < plan.prediction.seconds


def test_budget_too_small_names_the_smallest_budget():
    workload = Workload(named_shape("ab-ssd-bound"), 1, 4)
    with pytest.raises(BudgetTooSmall) as raised:
        best_plan_for(workload, machine(), 1e6, HorizontalSettings())
    smallest = raised.value.smallest_bytes
    assert f"{smallest / 2**30:.3f} GiB" in str(raised.value) and "--host-memory" in str(raised.value)
    plan = best_plan_for(workload, machine(), smallest, HorizontalSettings())  # exactly enough: spills everything
    assert plan.shares["act"] == pytest.approx(0.0, abs=1e-9)


def test_search_recommends_the_knee():
    plans = search(Workload(named_shape("ab-ssd-bound"), 1, 1), machine(), 64 * 2**30, HorizontalSettings(),
                   [1, 2, 4, 8, 16, 32, 64, 128])
    best = max(plan.prediction.tokens_per_second for plan in plans)
    chosen = plans[0]
    assert chosen.prediction.tokens_per_second >= 0.95 * best
    assert all(plan.prediction.tokens_per_second < 0.95 * best for plan in plans if plan.micro_batches < chosen.micro_batches)


def test_bad_workload_values():
    with pytest.raises(PlannerError, match="micro_batches must be at least 1, got 0"):
        Workload(named_shape("gpt-small"), 1, 0)
    with pytest.raises(PlannerError, match="deferred_layers must be between 0 and 6"):
        engine_phases(Workload(named_shape("gpt-small"), 1, 1), machine(), 7)
    with pytest.raises(PlannerError, match="multiple of heads"):
        GPTShape("bad", num_blocks=1, hidden=100, heads=3, vocab=10, seq_len=4)


def test_clipping_defers_every_update():
    """With clipping on (DeepSpeed 0.19.8's default when the key is absent) the engine defers every layer:
    the plan says so, and the head's fetch in backward reads serially after its update."""
    assert EngineSettings.from_settings(settings_from_ds_config({})).clipping
    assert not EngineSettings.from_settings(settings_from_ds_config({"gradient_clipping": 0.0})).clipping
    no_overlap = settings_from_ds_config({"greedysnake": {"optimizer_overlap": False}})
    assert not EngineSettings.from_settings(no_overlap).overlap
    workload = Workload(named_shape("gpt-small"), 4, 4)
    layers = len(workload.shape.layers)
    plan = best_plan_for(workload, machine(), 64 * 2**30, HorizontalSettings(), settings=EngineSettings(clipping=True))
    assert plan.deferred_layers == layers
    phases = engine_phases(workload, machine(), layers)
    head = next(phase for phase in phases if phase.name == f"backward[{layers - 1}]")
    assert head.serial.value({}) == pytest.approx(4 * workload.shape.layers[-1].params / (1000 * MIB))
    prefetched = next(phase for phase in engine_phases(workload, machine(), 1) if phase.name == head.name)
    assert prefetched.serial.value({}) == 0


def test_zero_infinity_without_recompute_reads_blocks_twice():
    hardware = machine(device_flops_per_s=1e15)
    shape = named_shape("ab-ssd-bound")
    per_step = {}
    for recompute in (True, False):
        settings = HorizontalSettings(recompute=recompute)
        times = [evaluate("zi", horizontal_phases(Workload(shape, 1, m), hardware, settings), Workload(shape, 1, m),
                          {}).seconds for m in (1, 2)]
        per_step[recompute] = times[1] - times[0]
    blocks = sum(4 * layer.swapped_params for layer in shape.layers if layer.checkpointed)
    assert per_step[True] - per_step[False] == pytest.approx(blocks / (500 * MIB), rel=0.01)


def test_gradient_slots_follow_the_engines_arena():
    """Gradients kept in host memory from the last layer down while they fit, as the engine's arena does;
    a plan's block asks for whole slots."""
    workload = Workload(named_shape("ab-ssd-bound"), 1, 4)
    embedding, block, head = (4 * layer.params for layer in workload.shape.layers[:2] + workload.shape.layers[-1:])
    total = embedding + 8 * block + head
    assert EngineSettings(gradient_host_bytes=2**30).shares(workload, 2**30)["grad"] == 1.0
    just_head_and_block = EngineSettings(gradient_host_bytes=head + block + 8192).shares(workload, 0)
    assert just_head_and_block["grad"] == pytest.approx((head + block) / total, rel=1e-3)
    assert just_head_and_block["act"] == 0.0
    assert EngineSettings(gradient_host_bytes=0).shares(workload, 0)["grad"] == 0.0
    plan = best_plan_for(workload, machine(), 64 * 2**30, HorizontalSettings())
    assert plan.shares["grad"] == 1.0
    assert plan.greedysnake_block()["gradient_host_memory_mb"] * MIB >= total
    # A budget that holds the staging buffers and half the gradients: whole slots only, never more than planned.
    tight = best_plan_for(workload, machine(), host_bytes(workload).const + total / 2, HorizontalSettings())
    assert 0 < tight.shares["grad"] + tight.shares["act"]
    assert tight.greedysnake_block()["gradient_host_memory_mb"] * MIB <= tight.shares["grad"] * total + MIB


def test_zero3_gradient_reduction_of_every_micro_batch_costs_compute_where_the_device_is_the_host():
    """On the CPU accelerator ZeRO-3 flattens, reduce-scatters and accumulates each micro-batch's gradient in
    the compute lane (a profile of ab_bench's ZeRO-Infinity step); on a GPU its link lane carries that."""
    import torch
    from ds_greedysnake.planner.probe import probe_zero_grad_reduce
    shape = GPTShape("tiny", num_blocks=2, hidden=64, heads=2, vocab=300, seq_len=32)
    workload = Workload(shape, 2, 4, 4, 4)
    settings = HorizontalSettings(prefetch=False, reuse_recompute_fetch=False)
    seconds = lambda hardware: evaluate("ZeRO-Infinity", horizontal_phases(workload, hardware, settings),  # noqa: E731
                                        workload, {}).seconds
    rate = 1e8
    without, host = seconds(machine()), seconds(machine(zero_grad_reduce_elements_per_s=rate))
    # Every layer's gradient, once per micro-batch (the compute lane binds: no prefetch, no link).
    assert host - without == pytest.approx(workload.micro_batches * shape.params / rate, rel=1e-9)
    on_gpu = dict(host_device_bytes_per_s=1e10)
    assert seconds(machine(zero_grad_reduce_elements_per_s=rate, **on_gpu)) == pytest.approx(seconds(machine(**on_gpu)))
    measured = probe_zero_grad_reduce(torch.device("cpu"), numel=1 << 16, repeats=2)
    assert measured is not None and measured > 0
    assert probe_zero_grad_reduce(torch.device("meta"), numel=1 << 16) is None
