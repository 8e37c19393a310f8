"""Saturated throughput: device memory of both engines, the micro-batch sweep under it, data parallelism,
the saturation reduction, ``--saturated`` and the paper setting's hardware file."""
import json
import os
import random

import pytest

from ds_greedysnake.planner import cli as plan_cli
from ds_greedysnake.planner.cost_model import Workload, evaluate
from ds_greedysnake.planner.zero_model import HorizontalSettings, horizontal_phases
from ds_greedysnake.planner.data_parallel import add_collectives, per_rank_hardware, sharded_shape
from ds_greedysnake.planner.device_memory import (greedysnake_device_bytes, persistent_elements,
                                                  zero_infinity_device_bytes)
from ds_greedysnake.planner.engine_model import engine_phases
from ds_greedysnake.planner.errors import PlannerError
from ds_greedysnake.planner.hardware import ASSUMPTION_SOURCES, Hardware, hardware_from_dict, load_hardware
from ds_greedysnake.planner.saturation import SweepPoint, SweepRequest, saturation_of, sweep
from ds_greedysnake.planner.shapes import GPTShape, named_shape
from ds_greedysnake.settings import settings_from_ds_config

MIB, GIB = 2**20, 2**30
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
A100 = os.path.join(REPO, "configs", "hardware", "a100_pcie4.json")
CONFIG = os.path.join(REPO, "configs", "greedysnake_gpt_small.json")


def machine(**overrides) -> Hardware:
    values = dict(name="test", source="unit test", ssd_read_bytes_per_s=1000 * MIB, ssd_write_bytes_per_s=800 * MIB,
                  adam_elements_per_s=2e9, device_flops_per_s=1e12, host_device_bytes_per_s=8e9,
                  device_memory_bytes=GIB, device_workspace_bytes=10 * MIB)
    values.update(overrides)
    return Hardware(**values)


def test_the_sweep_returns_exactly_the_configurations_that_fit_the_modelled_device_memory():
    """Must-show 3, property-style: random shapes, device memories and sweeps; every configuration the
    sweep returns fits the device memory it modelled (recomputed here), and every one it refused does not."""
    rng = random.Random(22)
    cases_swept = 0
    for case in range(16):
        heads = rng.choice([1, 2, 4])
        shape = GPTShape("random", num_blocks=rng.randint(1, 4), hidden=heads * rng.choice([16, 32, 64]), heads=heads,
                         vocab=rng.choice([64, 300, 1000]), seq_len=rng.choice([8, 32, 128]))
        hardware = machine(device_memory_bytes=rng.uniform(0.2, 20) * MIB, device_workspace_bytes=rng.uniform(0, 1) * MIB,
                           device_attention_keeps_scores=rng.random() < 0.5)
        settings = HorizontalSettings(prefetch=rng.random() < 0.5, reuse_recompute_fetch=rng.random() < 0.5,
                                      recompute=rng.random() < 0.5, prefetch_bucket_elements=rng.choice([0, 1e3, 1e5]),
                                      persistence_threshold=rng.choice([0, 100, 1e5]))
        sizes, counts = rng.sample([1, 2, 3, 4, 8, 16], 3), rng.sample([1, 2, 4, 8, 32], 2)
        request = SweepRequest(shape, hardware, GIB, settings, micro_batch_sizes=sizes, micro_batches=counts,
                               dtype_bytes=rng.choice([2, 4]), splits=[0], prefetch_depth=rng.choice([1, 2]))
        try:
            found = sweep(request)
        except PlannerError as error:
            assert "no configuration of the sweep fits" in str(error)
            found = None
        nothing_fits = []
        for engine in ("greedysnake", "zero_infinity"):
            modelled = {}
            for size in sizes:
                for m in counts:
                    workload = Workload(shape, size, m, request.dtype_bytes, request.dtype_bytes)
                    device = (greedysnake_device_bytes(workload, hardware, request.prefetch_depth)
                              if engine == "greedysnake" else zero_infinity_device_bytes(workload, hardware, settings))
                    modelled[(size, m)] = device.total
            fitting = {key for key, total in modelled.items() if total <= hardware.device_memory_bytes}
            nothing_fits.append(not fitting)
            if found is None:
                continue
            returned = {(p.micro_batch_size, p.micro_batches) for p in found[engine].points}
            assert returned == fitting, (case, engine)
            for point in found[engine].points:
                assert point.device.total == modelled[(point.micro_batch_size, point.micro_batches)]
                assert point.device.total <= hardware.device_memory_bytes
            assert {(s, m) for s, m, _ in found[engine].refused} == set(modelled) - fitting
        assert (found is None) == any(nothing_fits), case
        cases_swept += found is not None
    assert cases_swept >= 8  # the budgets are drawn so that most cases fit something


def test_greedysnake_device_memory_is_the_engines_buffers():
    hardware = machine()
    shape = named_shape("ab-ssd-bound")
    largest = max(layer.params for layer in shape.layers)
    one, eight = (greedysnake_device_bytes(Workload(shape, 2, m, 2, 2), hardware) for m in (1, 8))
    assert one.parameters == 2 * 2 * largest           # the layer computing and one prefetched, bf16
    assert one.gradients == (4 + 2) * largest          # the fp32 accumulator and autograd's bf16 gradient
    assert greedysnake_device_bytes(Workload(shape, 2, 1, 4, 4), hardware).gradients == 4 * largest
    boundary = 2 * 8 * shape.hidden * 2               # one micro-batch's activation at a layer boundary
    assert eight.checkpoints - one.checkpoints == 7 * boundary  # the activation gradients of every micro-batch
    assert eight.activations == one.activations and one.workspace == 10 * MIB
    deeper = greedysnake_device_bytes(Workload(shape, 2, 1, 2, 2), hardware, prefetch_depth=3)
    assert deeper.parameters - one.parameters == 2 * 2 * largest


def test_zero_infinity_device_memory_follows_its_own_rules():
    hardware = machine()
    shape = named_shape("ab-ssd-bound")
    vectors = sum(n for layer in shape.layers for n in layer.tensor_numels if n <= 1e5)
    assert persistent_elements(shape, 1e5) == vectors and persistent_elements(shape, 0) == 0
    workload = Workload(shape, 1, 4, 2, 2)
    base = HorizontalSettings(prefetch=False, reuse_recompute_fetch=True)
    reference = zero_infinity_device_bytes(workload, hardware, base)
    prefetching = zero_infinity_device_bytes(workload, hardware, HorizontalSettings(
        prefetch=True, reuse_recompute_fetch=True, prefetch_bucket_elements=1000))
    assert prefetching.parameters - reference.parameters == 2 * 1000
    capped = zero_infinity_device_bytes(workload, hardware, HorizontalSettings(
        prefetch=True, reuse_recompute_fetch=True, max_live_parameters=10))
    largest_tensor = max(n for layer in shape.layers for n in layer.tensor_numels)
    assert capped.parameters == 2 * (vectors + largest_tensor)  # never below the tensor in use
    # Activation checkpointing: every block's input stays on the device for the micro-batch; M does not matter.
    assert reference.checkpoints == (shape.num_blocks + 2) * workload.checkpoint_bytes
    assert zero_infinity_device_bytes(Workload(shape, 1, 64, 2, 2), hardware, base).total == reference.total
    without = zero_infinity_device_bytes(workload, hardware, HorizontalSettings(recompute=False))
    assert without.checkpoints > reference.checkpoints
    read = HorizontalSettings.from_settings(settings_from_ds_config({"zero_optimization": {
        "stage3_prefetch_bucket_size": 123, "stage3_param_persistence_threshold": 7, "stage3_max_live_parameters": 9,
        "reduce_bucket_size": 11}}))
    assert (read.prefetch, read.prefetch_bucket_elements, read.persistence_threshold, read.max_live_parameters,
            read.reduce_bucket_elements) == (True, 123, 7, 9, 11)


def test_attention_scores_and_the_head_dominate_as_the_kernel_says():
    shape = named_shape("gpt-65b")
    # GPT-65B: the head's logits, vocab x (2 + 2 + 12) bytes per token, beat a block's 18 x hidden x 2.
    assert greedysnake_device_bytes(Workload(shape, 1, 1, 2, 2), machine()).activations == 2048 * shape.vocab * 16
    narrow = GPTShape("small vocabulary", num_blocks=2, hidden=1024, heads=16, vocab=1000, seq_len=2048)
    workload = Workload(narrow, 3, 1, 2, 2)
    fused = greedysnake_device_bytes(workload, machine())
    plain = greedysnake_device_bytes(workload, machine(device_attention_keeps_scores=True))
    assert fused.activations == 3 * 2048 * 18 * 1024 * 2
    assert plain.activations - fused.activations == 3 * 2048 * 16 * 2048 * 2  # heads x seq scores per token


def test_zero_infinity_adds_each_gradient_to_the_one_in_host_memory_over_the_link():
    hardware = machine()
    shape = named_shape("ab-ssd-bound")
    link = {}
    for m in (1, 4):
        workload = Workload(shape, 1, m, 2, 2)
        phases = horizontal_phases(workload, hardware, HorizontalSettings())
        link[m] = next(p for p in phases if p.name == "backward[1]").lanes["host link"].value({})
    block = shape.layers[1].params
    assert link[4] - link[1] == pytest.approx(2 * 2 * block * 3 / 4 / 8e9)


def test_saturation_of_takes_the_best_per_global_batch_and_the_first_within_the_knee():
    points = [SweepPoint("x", 1, 1, 1, 10, 1), SweepPoint("x", 2, 1, 1, 30, 1), SweepPoint("x", 1, 2, 1, 20, 1),
              SweepPoint("x", 4, 1, 1, 96, 1), SweepPoint("x", 1, 8, 1, 100, 1), SweepPoint("x", 2, 8, 1, 99, 1)]
    curve, plateau, knee = saturation_of(points)
    assert [(p.global_batch, p.tokens_per_second) for p in curve] == [(1, 10), (2, 30), (4, 96), (8, 100), (16, 99)]
    assert plateau.tokens_per_second == 100 and knee.global_batch == 4
    assert saturation_of(points, knee=0.999)[2].global_batch == 8


def test_data_parallel_ranks_share_the_ssd_so_a_rank_steps_as_one_device_does():
    """Each rank stores 1/W of every layer on an SSD shared by W ranks: without a link and with host memory
    to spare, a rank's step at the same micro-batches equals the one-device step."""
    hardware = machine(host_device_bytes_per_s=None, device_memory_bytes=None)
    shape = named_shape("ab-ssd-bound")
    sharded = sharded_shape(shape, 4)
    assert [l.params for l in sharded.layers] == [-(-l.params // 4) for l in shape.layers]
    assert [l.forward_flops_per_token for l in sharded.layers] == [l.forward_flops_per_token for l in shape.layers]
    rank = per_rank_hardware(hardware, 4)
    assert rank.ssd_read_bytes_per_s == hardware.ssd_read_bytes_per_s / 4 and rank.adam_elements_per_s == 5e8
    one = evaluate("gs", engine_phases(Workload(shape, 1, 4), hardware, 2), Workload(shape, 1, 4), {"act": 1})
    four = evaluate("gs", engine_phases(Workload(sharded, 1, 4), rank, 2), Workload(sharded, 1, 4), {"act": 1})
    assert four.seconds == pytest.approx(one.seconds, rel=0.01)
    for ranks, expected in ((1, 1), (4, 4)):
        found = sweep(SweepRequest(shape, hardware, 64 * GIB, micro_batch_sizes=[1], micro_batches=[4], ranks=ranks,
                                   dtype_bytes=4, splits=[2], engines=("zero_infinity",)))["zero_infinity"]
        assert found.plateau.global_batch == 4 * expected
    with pytest.raises(PlannerError, match="ranks must be a positive integer"):
        sharded_shape(shape, 0)


def test_collectives_add_the_gathered_and_reduced_bytes_to_each_ranks_link():
    hardware = machine()
    shape = named_shape("ab-ssd-bound")
    workload = Workload(sharded_shape(shape, 4), 1, 2)
    block = shape.layers[1].params
    for reuse, fetches in ((True, 1), (False, 2)):  # backward re-gathers a checkpointed block without reuse
        settings = HorizontalSettings(prefetch=True, reuse_recompute_fetch=reuse)
        phases = horizontal_phases(workload, hardware, settings)
        before = {p.name: p.lanes["host link"].value({}) for p in phases if "host link" in p.lanes}
        add_collectives(phases, shape, Workload(shape, 1, 2), hardware, 4, "zero_infinity", settings)
        after = {p.name: p.lanes["host link"].value({}) for p in phases if "host link" in p.lanes}
        assert after["forward[1]"] - before["forward[1]"] == pytest.approx(0.75 * 4 * block / 8e9)
        # Gathered parameters and the gradient's reduce-scatter, in the compute dtype (fp32 here).
        assert after["backward[1]"] - before["backward[1]"] == pytest.approx(0.75 * (fetches + 1) * 4 * block / 8e9)
    phases = engine_phases(workload, hardware, 2)
    before = {p.name: p.lanes["host link"].value({}) for p in phases if "host link" in p.lanes}
    add_collectives(phases, shape, Workload(shape, 1, 2), hardware, 4, "greedysnake")
    after = {p.name: p.lanes["host link"].value({}) for p in phases if "host link" in p.lanes}
    # greedysnake: the fp32 accumulator reduce-scattered once per step; layer L-2 is not gathered again.
    assert after["backward[1]"] - before["backward[1]"] == pytest.approx(0.75 * (4 + 4) * block / 8e9)
    last_block = len(shape.layers) - 2
    assert after[f"backward[{last_block}]"] - before[f"backward[{last_block}]"] == pytest.approx(0.75 * 4 * block / 8e9)
    unchanged = [p.lanes["host link"].value({}) for p in phases if "host link" in p.lanes]
    add_collectives(phases, shape, Workload(shape, 1, 2), hardware, 1, "greedysnake")
    assert [p.lanes["host link"].value({}) for p in phases if "host link" in p.lanes] == unchanged


def test_cli_saturated_json_and_text(capsys):
    args = ["--config", CONFIG, "--hardware", A100, "--model", "gpt-small", "--saturated", "--micro-batch-sizes",
            "1", "64", "--micro-batches", "1", "4"]
    assert plan_cli.main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    device = load_hardware(A100).device_memory_bytes
    for engine in ("greedysnake", "zero_infinity"):
        saturation = report["saturations"][engine]
        assert {(p["micro_batch_size"], p["micro_batches"]) for p in saturation["points"]} == {
            (1, 1), (1, 4), (64, 1), (64, 4)}
        assert all(p["device_bytes"]["total"] <= device for p in saturation["points"])
        assert saturation["plateau"]["tokens_per_second"] == max(p["tokens_per_second"] for p in saturation["points"])
    assert report["ratio"] == pytest.approx(report["saturations"]["greedysnake"]["plateau"]["tokens_per_second"]
                                            / report["saturations"]["zero_infinity"]["plateau"]["tokens_per_second"])
    assert plan_cli.main(args + ["--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "ratio of the saturated throughputs" in out and "(saturation point)" in out
    assert plan_cli.main(args[:-4] + ["--micro-batch-sizes", "0"]) == 2
    assert "micro batch sizes must be positive integers" in capsys.readouterr().err
    assert plan_cli.main(["--config", CONFIG, "--hardware", A100, "--ranks", "2"]) == 2
    assert "apply to --saturated only" in capsys.readouterr().err


def test_the_paper_settings_hardware_file_states_where_every_number_comes_from():
    with open(A100) as handle:
        data = json.load(handle)
    hardware = hardware_from_dict(data)
    stated = {key for key, value in data.items() if isinstance(value, (int, float)) and key != "assumptions"}
    assert stated and stated <= set(hardware.assumptions)
    assert all(entry["source"] in ASSUMPTION_SOURCES and entry["note"] for entry in hardware.assumptions.values())
    assert {"model.gpt-65b", "model.gpt-175b", "model.seq_len", "setting.paper_ratios"} <= set(hardware.assumptions)
    data["assumptions"]["ssd_read_bytes_per_s"] = {"source": "a hunch", "note": ""}
    with pytest.raises(PlannerError, match="must be an object with \"source\" one of paper"):
        hardware_from_dict(data)


def _saturation_accuracy():
    import sys
    sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))
    import saturation_accuracy
    return saturation_accuracy


def test_measured_runs_reduce_as_the_sweep_does():
    """scripts/bench/saturation_accuracy.py: ab_bench runs and their predictions, through saturation_of."""
    saturation_accuracy = _saturation_accuracy()
    runs, rows = [], []
    for engine, seconds in (("zero_infinity", (1.0, 3.0, 2.0)), ("greedysnake", (0.5, 1.0, 0.9))):
        for (size, m), measured in zip(((1, 1), (1, 4), (4, 1)), seconds):
            runs.append({"engine": engine, "micro_batch_size": size, "micro_batches": m, "tokens_per_step": 8 * size * m})
            rows.append({"engine": engine, "micro_batches": m, "measured_seconds": measured,
                         "predicted_seconds": 1.1 * measured, "binding": "SSD"})
    runs.append({"engine": "greedysnake", "micro_batch_size": 1, "micro_batches": 8, "world_size": 2,
                 "tokens_per_step": 128})  # two ranks: not predicted, left out
    measured, predicted = saturation_accuracy.points_of({"runs": runs}, rows)
    result = saturation_accuracy.compare(measured, predicted)
    # Global batch 4 twice (1 x 4 and 4 x 1): the faster one counts.
    assert [p["tokens_per_second"] for p in result["zero_infinity"]["measured"]["curve"]] == [8.0, 16.0]
    assert result["greedysnake"]["measured"]["plateau"]["micro_batch_size"] == 4
    assert result["greedysnake"]["plateau_ratio"] == pytest.approx(1 / 1.1)
    assert "saturated ratio greedysnake / ZeRO-Infinity: measured" in saturation_accuracy.markdown(result)


def test_a_run_between_two_probes_is_predicted_at_the_geometric_mean_of_theirs():
    """saturation_accuracy's bracketing: the probe before and the probe after a size's runs."""
    bracket = _saturation_accuracy()
    before = {"engine": "greedysnake", "micro_batches": 4, "measured_seconds": 2.0, "predicted_seconds": 1.0,
              "ratio": 0.5, "binding": "SSD"}
    after = dict(before, predicted_seconds=4.0, ratio=2.0, binding="compute")
    row = bracket.bracketed_row(before, after)
    assert row["predicted_seconds"] == pytest.approx(2.0) and row["ratio"] == pytest.approx(1.0)
    assert (row["predicted_seconds_before"], row["predicted_seconds_after"], row["ratio_after"]) == (1.0, 4.0, 2.0)
    assert row["binding"] == "SSD / compute"
    assert bracket.bracketed_row(before, dict(before, predicted_seconds=1.0))["binding"] == "SSD"
    assert "| 4 | greedysnake | 2.000 | 1.000 / 4.000 | 0.25 | 2.00, 1.00 |" in bracket.drift_markdown([row])
    with pytest.raises(AssertionError):
        bracket.bracketed_row(before, dict(after, micro_batches=8))

    point = lambda m, seconds, binding="SSD": {"engine": "x", "micro_batch_size": 2, "micro_batches": m,  # noqa: E731
                                              "ranks": 1, "seconds": seconds, "tokens_per_second": 64 * m / seconds,
                                              "binding": binding}
    plan = lambda *points: {"hardware": {}, "saturations": {"x": {"points": list(points)}}}  # noqa: E731
    combined = bracket.bracketed_plan(plan(point(1, 1.0), point(4, 2.0)), plan(point(1, 4.0, "Adam"), point(4, 2.0)))
    first, second = combined["saturations"]["x"]["points"]
    assert (first["seconds"], first["tokens_per_second"], first["binding"]) == (pytest.approx(2.0), pytest.approx(32.0),
                                                                                "SSD / Adam")
    assert second["seconds"] == pytest.approx(2.0) and second["binding"] == "SSD"
    merged = bracket.merged_plan([combined])
    assert merged["saturations"]["x"]["plateau"]["micro_batches"] == 4
    with pytest.raises(SystemExit, match="planned different x configurations"):
        bracket.bracketed_plan(plan(point(1, 1.0)), plan(point(1, 1.0), point(8, 1.0)))


def test_the_probe_before_the_runs_plans_the_ds_config_ab_bench_will_run():
    """The probe before a size's runs is given the configurations and ds_config ab_bench builds for them."""
    bracket = _saturation_accuracy()
    args = bracket.AB_BASE_ARGS + " --hidden 640 --layers 6 --seq-len 40"
    report = bracket.report_before_runs(4, args, [1, 8])
    import ab_bench_setup  # on the path once report_before_runs has run
    spec = dict(ab_bench_setup.QUICK_CONFIGS["ssd_bound"], hidden=640, layers=6, seq_len=40, micro_batch_size=4)
    assert report["configs"] == {"ssd_bound": spec}
    assert [(run["engine"], run["micro_batch_size"], run["micro_batches"]) for run in report["runs"]] == [
        ("greedysnake", 4, 1), ("greedysnake", 4, 8)]
    built = ab_bench_setup.ds_config("/x", 4, 8, True, ab_bench_setup.largest_param_numel(spec))
    planned = report["runs"][1]["ds_config"]
    for config in (built, planned):
        for section in ("offload_param", "offload_optimizer"):
            config["zero_optimization"][section].pop("nvme_path")
    assert planned == built



@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                       ("always madvise never", None)])
def test_the_huge_page_mode_recorded_is_the_bracketed_one(tmp_path, text, mode):
    """saturation_accuracy records the kernel's transparent huge page mode (it moved this machine's disk rate
    by up to 2x per process, and ZeRO-3's reductions)."""
    bracket = _saturation_accuracy()
    setting = tmp_path / "enabled"
    setting.write_text(text)
    assert bracket.transparent_hugepages(str(setting)) == mode
    assert bracket.transparent_hugepages(str(tmp_path / "missing")) is None


def test_the_zero_probe_processes_reach_plan_only_when_asked():
    bracket = _saturation_accuracy()
    import argparse
    assert bracket.plan_args(argparse.Namespace(zero_probe_processes=1)) == ()
    assert bracket.plan_args(argparse.Namespace(zero_probe_processes=3)) == ("--zero-probe-processes", "3")


def _ab_report(seconds_by_run):
    runs = [{"config": "ssd_bound", "engine": engine, "micro_batches": m, "step_seconds_median": seconds,
             "seconds_by_op_mean": {"marker": seconds}} for (engine, m), seconds in seconds_by_run.items()]
    return {"configs": {"ssd_bound": {}}, "runs": runs}


def test_repeated_runs_keep_the_median_process_whole():
    """--repeats: each run is the whole record of the repeat whose step is the median (the lower middle one
    for an even count), every repeat's step kept beside it."""
    bracket = _saturation_accuracy()
    reports = [_ab_report({("greedysnake", 1): g, ("zero_infinity", 1): z})
               for g, z in ((1.0, 5.0), (3.0, 4.0), (2.0, 9.0))]
    merged = bracket.median_report(reports)
    greedysnake, zero = merged["runs"]
    assert (greedysnake["step_seconds_median"], greedysnake["repeat_chosen"]) == (2.0, 2)
    assert greedysnake["seconds_by_op_mean"] == {"marker": 2.0}  # the chosen process's own profile
    assert greedysnake["step_seconds_by_repeat"] == [1.0, 3.0, 2.0]
    assert (zero["step_seconds_median"], zero["repeat_chosen"]) == (5.0, 0)
    assert merged["repeats"] == 3 and "step_seconds_by_repeat" not in reports[0]["runs"][0]
    assert bracket.median_report(reports[:2])["runs"][1]["step_seconds_median"] == 4.0
    assert bracket.median_report(reports[:1]) is reports[0]
    with pytest.raises(SystemExit, match="the repeats ran different sweeps"):
        bracket.median_report([reports[0], _ab_report({("greedysnake", 4): 1.0, ("zero_infinity", 1): 1.0})])


def test_each_size_runs_its_repeats_in_their_own_folders_and_is_predicted_from_their_median(tmp_path, monkeypatch):
    bracket = _saturation_accuracy()
    steps = iter([1.0, 3.0, 2.0])

    def fake_run(size, ab_args, out_dir, micro_batches, repeat=None):
        path = os.path.join(out_dir, f"mbs{size}_r{repeat}", "ab_bench.json")
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as handle:
            json.dump(_ab_report({("greedysnake", 1): next(steps)}), handle)
        return path
    monkeypatch.setattr(bracket, "run_ab_bench", fake_run)
    sweep = bracket.Sweep("probe", str(tmp_path), with_plan=False, repeats=3)
    path, report = sweep.run_repeats(2, "", str(tmp_path), [1])
    assert sorted(os.listdir(tmp_path)) == ["mbs2_median.json", "mbs2_r0", "mbs2_r1", "mbs2_r2"]
    with open(path) as handle:
        assert json.load(handle) == report
    assert report["runs"][0]["step_seconds_median"] == 2.0


def test_runs_outside_are_counted_against_each_repeat_alone_too():
    bracket = _saturation_accuracy()
    rows = [{"predicted_seconds": 1.0, "measured_seconds": 1.0, "measured_seconds_by_repeat": [1.0, 0.7, 1.5]},
            {"predicted_seconds": 2.0, "measured_seconds": 2.0, "measured_seconds_by_repeat": [2.0, 2.1, 1.0]}]
    assert bracket.runs_outside_by_repeat(rows) == [0, 1, 2]  # 0.7 s: 1.43x; 1.5 and 1.0 s: 0.67x, 2x
    assert bracket.runs_outside_by_repeat([{"predicted_seconds": 1.0}]) is None
    point = {"tokens_per_second": 10.0, "micro_batch_size": 1, "micro_batches": 4}
    item = {"shape": "s", "engine": "greedysnake", "measured": point, "plan": point, "plan_ratio": 1.0,
            "per_run_ratio": 1.0, "worst_run": {"micro_batches": 4, "measured_seconds": 1.0, "predicted_seconds": 1.5,
                                                "ratio": 1.5, "binding": "SSD"},
            "runs": 2, "runs_outside": 1, "runs_outside_after_probe_alone": 2}
    table = bracket.summary_markdown([dict(item, runs_outside_by_repeat=[0, 1, 1]), item])
    assert "| 1 of 2 (2) | 0, 1, 1 |" in table and table.endswith("| 1 of 2 (2) | - |")


@pytest.mark.parametrize("argv,message", [(["--run", "1", "--repeats", "0"], "--repeats must be at least 1, got 0"),
                                          (["--ab-json", "x.json", "--repeats", "3"], "--repeats 3 needs --run")])
def test_repeats_are_refused_where_they_cannot_apply(argv, message, capsys):
    bracket = _saturation_accuracy()
    with pytest.raises(SystemExit):
        bracket.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("dtype_bytes", [4, 2])
def test_the_working_set_estimate_matches_what_autograd_keeps_for_the_built_gpt(dtype_bytes):
    """What the built GPT's block and head keep for backward (autograd's saved tensors, counted once per
    storage): a block 16 hidden elements per token, as device_memory assumes (plus 2 hidden for the input
    and output gradient); the head less than the estimate, which adds backward's transients."""
    import torch
    from ds_greedysnake.models.gpt import GPTConfig, build_gpt, lm_loss
    from ds_greedysnake.planner.device_memory import layer_working_set_bytes
    dtype = torch.float32 if dtype_bytes == 4 else torch.bfloat16
    shape = GPTShape("tiny", num_blocks=1, hidden=64, heads=4, vocab=300, seq_len=32)
    model = build_gpt(GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq_len, hidden=shape.hidden,
                                num_heads=shape.heads, num_layers=1)).to(dtype)
    weights = {p.data_ptr() for p in model.parameters()}

    def saved_bytes(run) -> int:
        storages = {}

        def pack(tensor):
            if tensor.data_ptr() not in weights and tensor.numel() > 1:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            run()
        return sum(storages.values())

    tokens = 2 * shape.seq_len
    hidden = torch.randn(2, shape.seq_len, shape.hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, shape.vocab, (2, shape.seq_len))
    block_estimate = layer_working_set_bytes(shape.layers[1], shape, tokens, dtype_bytes, keeps_scores=False)
    block_saved = saved_bytes(lambda: model[1](hidden))
    assert block_saved == pytest.approx(block_estimate - 2 * tokens * shape.hidden * dtype_bytes, rel=0.02)
    head_saved = saved_bytes(lambda: lm_loss(model[2](hidden), labels))
    head_estimate = layer_working_set_bytes(shape.layers[2], shape, tokens, dtype_bytes, keeps_scores=False)
    assert 4 * tokens * shape.vocab <= head_saved < head_estimate  # at least the fp32 log-softmax kept


def test_the_sweep_predicts_each_micro_batch_size_from_the_layer_times_the_probe_measured_for_it(tmp_path):
    """``plan --saturated`` on the probe: the probe times the layers at every micro-batch size of the
    sweep (``Hardware.timed_workloads``); each size's predictions use its own times, the others FLOP/s."""
    from ds_greedysnake.planner.hardware import LayerTimes, WorkloadTimes, save_hardware
    shape = GPTShape("tiny", num_blocks=2, hidden=64, heads=2, vocab=300, seq_len=32)
    key = lambda size: Workload(shape, size, 1, 4, 4).compute_key()  # noqa: E731
    slow = {kind: LayerTimes(1.0, 3.0) for kind in ("embedding", "block", "head")}
    plain = machine(device_memory_bytes=None, host_device_bytes_per_s=None)
    timed = machine(device_memory_bytes=None, host_device_bytes_per_s=None,
                    layer_times={kind: LayerTimes(0.5, 1.5) for kind in slow}, layer_times_for=key(1),
                    timed_workloads={key(4): WorkloadTimes(slow, 1.5)})
    request = lambda hardware: SweepRequest(shape, hardware, GIB, micro_batch_sizes=[1, 2, 4],  # noqa: E731
                                            micro_batches=[1, 8], dtype_bytes=4, splits=[0])
    by_config = lambda found: {(p.engine, p.micro_batch_size, p.micro_batches): p.seconds  # noqa: E731
                               for saturation in found.values() for p in saturation.points}
    with_times, from_flops = by_config(sweep(request(timed))), by_config(sweep(request(plain)))
    for (engine, size, m), seconds in with_times.items():
        if size == 2:   # not timed: FLOP/s, as without any times
            assert seconds == pytest.approx(from_flops[engine, size, m])
        else:           # timed: at least M micro-batches of the measured block, forward and backward
            assert seconds >= m * len(shape.layers) * (0.5 if size == 1 else 1.0), (engine, size, m)
    assert with_times["greedysnake", 4, 8] > 1.8 * with_times["greedysnake", 1, 8]
    # The timed workloads survive a hardware file, and a workload the probe did not time is left alone.
    save_hardware(timed, str(tmp_path / "probe.json"))
    loaded = load_hardware(str(tmp_path / "probe.json"))
    assert loaded.timed_workloads == timed.timed_workloads
    four = loaded.for_workload(key(4))
    assert four.layer_times == slow and four.layer_times_for == key(4) and four.compute_slowdown_sharing_cores == 1.5
    assert loaded.for_workload(key(2)) is loaded and loaded.for_workload(key(1)) is loaded
    with pytest.raises(PlannerError, match="timed_workloads"):
        hardware_from_dict(dict(timed.to_dict(), timed_workloads={key(4): {"layer_times": {"block": {"x": 1}}}}))


def test_the_probe_times_each_further_micro_batch_size_it_can_build_and_no_other():
    import torch
    from ds_greedysnake.planner.probe import probe_more_workloads, timeable
    shape = GPTShape("tiny", num_blocks=1, hidden=32, heads=2, vocab=64, seq_len=8)
    workload = Workload(shape, 1, 1, 4, 4)
    timed = probe_more_workloads(workload, [1, 2, 3], torch.device("cpu"), settings_from_ds_config({}), repeats=3)
    assert sorted(timed) == sorted(Workload(shape, size, 1, 4, 4).compute_key() for size in (2, 3))
    for times in timed.values():
        assert set(times.layer_times) == {"embedding", "block", "head"}
        assert all(t.forward_s > 0 and t.forward_backward_s > 0 for t in times.layer_times.values())
        # The engine's training threads and the worker beside them, each a slow-down of at least 1.
        assert times.engine_threads_slowdown >= 1 and times.compute_slowdown_sharing_cores >= 1
    # A working set of several GiB (GPT-65B's head at 64 x 2048 tokens) is not built: FLOP/s instead.
    assert not timeable(Workload(named_shape("gpt-65b"), 64, 1, 2, 2))
    assert timeable(workload)
