"""PipeshardParallel end to end on 2 simulated hosts × 4 devices, local and Ray runtimes: losses and
parameters against PyTorch on the full batch, and failures that must surface as clear errors."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

import torchpar
from tests.runtime.ray_helpers import local_cluster, ray_cluster
from torchpar.cluster import shutdown
from torchpar.harness import zoo

LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6
STEPS = 5


@pytest.fixture(scope="module", params=["local", "ray"])
def runtime(request):
    if request.param == "ray":
        with ray_cluster(num_hosts=2, devices_per_host=4):
            yield request.param
        return
    torchpar.init(cluster=request.param, num_hosts=2, devices_per_host=4)
    yield request.param
    shutdown()
    torchpar.init(cluster="local", num_devices=8)


class BoundaryMLP(torch.nn.Module):
    """Linear+ReLU layers with a pipeline boundary after each, and an MSE loss."""

    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, y):
        for index, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if index < len(self.layers) - 1:
                x = torchpar.mark_pipeline_boundary(x)
        return torch.nn.functional.mse_loss(x, y)


def _gpt2_with_boundaries(num_layers: int):
    """A tiny HF GPT-2 whose blocks end in mark_pipeline_boundary (via forward hooks)."""
    model, batch = zoo.build("gpt2", {"n_layer": num_layers}, batch_size=8, seq_len=16)

    def mark(module, inputs, output):
        if isinstance(output, tuple):
            return (torchpar.mark_pipeline_boundary(output[0]),) + output[1:]
        return torchpar.mark_pipeline_boundary(output)

    for block in model.transformer.h[:-1]:
        block.register_forward_hook(mark)
    return model, batch


def _build(family: str, layers: str, stages: int):
    torch.manual_seed(0)
    if family == "mlp":
        model = BoundaryMLP(depth=4)
        batch = (torch.randn(16, 32), torch.randn(16, 32))
    else:
        model, batch = _gpt2_with_boundaries(4) if layers == "manual" else zoo.build("gpt2", {"n_layer": 4},
                                                                                      batch_size=8, seq_len=16)
    layer_option = "manual" if layers == "manual" else torchpar.AutoLayerOption(layer_num=4)
    per_stage = 4 // stages
    stage_option = torchpar.ManualStageOption(
        forward_stage_layer_ids=tuple(tuple(range(s * per_stage, (s + 1) * per_stage)) for s in range(stages)),
        submesh_physical_shapes=((1, 8 // stages),) * stages,
        submesh_logical_shapes=((1, 8 // stages),) * stages)
    return model, batch, layer_option, stage_option


def _loss(model, batch):
    return model(*batch) if isinstance(batch, tuple) else model(**batch).loss


CASES = [  # (family, layer option, stages, schedule, micro-batches): every axis once on each family — the MLP
    # (cheap) takes every layer option × stage count, GPT-2 (a tied embedding across stages) both schedules and
    # layer options
    ("mlp", "manual", 2, "gpipe", 1),
    ("mlp", "manual", 4, "1f1b", 4),
    ("mlp", "auto", 2, "1f1b", 2),
    ("mlp", "auto", 4, "gpipe", 2),
    ("gpt2", "manual", 2, "1f1b", 2),
    ("gpt2", "auto", 2, "gpipe", 1),
]
RAY_CASES = [CASES[3], CASES[4]]  # each axis once: both families, schedules, layer options, 2 and 4 stages


def _train_beside(engine, reference, ref_opt, batch) -> None:
    """STEPS steps of ``engine`` and of the PyTorch ``reference`` on ``batch``, the losses equal within LOSS_RTOL."""
    for _ in range(STEPS):
        ref_opt.zero_grad()
        loss = _loss(reference, batch)
        loss.backward()
        ref_opt.step()
        assert engine.step(batch) == pytest.approx(loss.item(), rel=LOSS_RTOL)


def _ids(cases):
    return [f"{f}-{l}-{s}st-{sc}-M{m}" for f, l, s, sc, m in cases]


# The Ray runtime runs the same workers, interpreter and transport as the local one; it gets the subset
# RAY_CASES here (more in tests/runtime/test_ray_engine.py)
@pytest.mark.parametrize("runtime,case", [("local", c) for c in CASES] + [("ray", c) for c in RAY_CASES],
                         ids=[f"local-{i}" for i in _ids(CASES)] + [f"ray-{i}" for i in _ids(RAY_CASES)],
                         indirect=["runtime"])
def test_pipeline_matches_pytorch(runtime, case):
    family, layers, stages, schedule, micro = case
    model, batch, layer_option, stage_option = _build(family, layers, stages)
    reference = copy.deepcopy(model)
    # SGD with momentum: its parameters are compared element-wise (Adam amplifies round-off; see tests/models)
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    method = torchpar.PipeshardParallel(num_micro_batches=micro, layer_option=layer_option, stage_option=stage_option,
                                        schedule=schedule)
    engine = torchpar.compile(model, make_opt(model), example_batch=batch, method=method)
    try:
        assert len(engine.plan.stages) == stages
        _train_beside(engine, reference, make_opt(reference), batch)
        engine.sync_to_torch()
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(q, p, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
    finally:
        engine.shutdown()


# Issue 12's schedules: (family, device groups, schedule, micro-batches). Interleaved 1F1B runs 2 stages per
# group (a 4-layer model on 2 groups, an 8-layer one on 4: stage s on the devices of group s mod G); ZB-H1 runs
# one stage per group with each backward split into its input- and weight-gradient parts.
SCHEDULE_CASES = [
    ("mlp", 2, "zb_h1", 4),
    ("mlp", 4, "zb_h1", 8),
    ("mlp", 2, "interleaved_1f1b", 4),
    ("mlp", 4, "interleaved_1f1b", 8),
    ("gpt2", 2, "zb_h1", 2),
    ("gpt2", 2, "interleaved_1f1b", 2),
]  # the MLP takes every schedule × group count; GPT-2 (a tied embedding across stages) both schedules on 2 groups
# The Ray runtime runs the same workers, transport aside: each axis once — both schedules, 2 and 4 device groups,
# both families (interleaved stages wrapping around the hosts with GPT-2's tied embedding)
RAY_SCHEDULE_CASES = [("mlp", 4, "zb_h1", 8), ("gpt2", 2, "interleaved_1f1b", 2)]


def _build_for_schedule(family: str, groups: int, schedule: str):
    """A model with one layer per stage (``groups`` stages, or 2 per group under interleaved 1F1B), the
    stages on ``groups`` submeshes of ``8 / groups`` devices."""
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    num_stages = groups * virtual
    torch.manual_seed(0)
    if family == "mlp":
        model = BoundaryMLP(depth=num_stages)
        batch = (torch.randn(16, 32), torch.randn(16, 32))
    else:
        model, batch = _gpt2_with_boundaries(num_stages)
    stage_option = torchpar.ManualStageOption(
        forward_stage_layer_ids=tuple((s,) for s in range(num_stages)),
        submesh_physical_shapes=((1, 8 // groups),) * num_stages,
        submesh_logical_shapes=((1, 8 // groups),) * num_stages)
    return model, batch, stage_option, virtual


@pytest.mark.parametrize("runtime,case",
                         [("local", c) for c in SCHEDULE_CASES] + [("ray", c) for c in RAY_SCHEDULE_CASES],
                         ids=[f"local-{f}-{g}groups-{sc}-M{m}" for f, g, sc, m in SCHEDULE_CASES]
                         + [f"ray-{f}-{g}groups-{sc}-M{m}" for f, g, sc, m in RAY_SCHEDULE_CASES],
                         indirect=["runtime"])
def test_new_schedules_match_pytorch(runtime, case, tmp_path):
    family, groups, schedule, micro = case
    model, batch, stage_option, virtual = _build_for_schedule(family, groups, schedule)
    reference = copy.deepcopy(model)
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    method = torchpar.PipeshardParallel(num_micro_batches=micro, layer_option="manual", stage_option=stage_option,
                                        schedule=schedule)
    assert method.virtual_stages == (virtual if schedule == "interleaved_1f1b" else None)
    engine = torchpar.compile(model, make_opt(model), example_batch=batch, method=method)
    try:
        stages = engine.plan.stages
        assert len(stages) == groups * virtual and engine.plan.schedule == schedule
        assert all(stages[s].device_ids == stages[s % groups].device_ids for s in range(len(stages)))
        _train_beside(engine, reference, make_opt(reference), batch)
        timeline = engine.last_timeline
        assert len(timeline.blocks) == groups  # one row per device group
        ops = {b[0] for row in timeline.blocks for b in row}
        assert ops == ({"forward", "backward_input", "backward_weight"} if schedule == "zb_h1"
                       else {"forward", "backward"})
        assert all(len([b for b in row if b[0] == "forward"]) == micro * virtual for row in timeline.blocks)
        assert schedule in engine.plan.solver["estimate"]["step_formula"]
        if runtime == "local" and schedule == "zb_h1":  # only B and W run: the fused backward never compiles
            assert all(p._backward._cache_size() == 0 and p._backward_accumulate._cache_size() == 0
                       for p in engine.executor.worker.programs.values())
        for drawn in (None, timeline):  # the report draws the simulated schedule and the measured step, per group
            engine.plan.save_html(str(tmp_path / "plan.html"), timeline=drawn)
        engine.sync_to_torch()
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(q, p, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("runtime", ["local"], indirect=True)
def test_auto_stages_plan_interleaved_1f1b(runtime):
    """stage_option='auto' under interleaved 1F1B: the interleaved stage DP puts 2 stages on each of G equal device
    groups (stage s on group s mod G), the ILP refines them, and the engine trains as PyTorch does."""
    torch.manual_seed(0)
    model = BoundaryMLP(depth=8)
    batch = (torch.randn(16, 32), torch.randn(16, 32))
    reference = copy.deepcopy(model)
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    method = torchpar.PipeshardParallel(num_micro_batches=4, layer_option="manual", stage_option="auto",
                                        schedule="interleaved_1f1b")
    engine = torchpar.compile(model, make_opt(model), example_batch=batch, method=method)
    try:
        stages = engine.plan.stages
        groups = len(stages) // 2
        assert len(stages) == 2 * groups and groups >= 2
        assert all(stages[s].device_ids == stages[s % groups].device_ids for s in range(len(stages)))
        assert [l for s in stages for l in s.layers] == list(range(8))
        assert "interleaved_1f1b" in engine.plan.solver["estimate"]["step_formula"]
        assert engine.plan.solver["stage_partition"]["estimated_step_s"] > 0
        _train_beside(engine, reference, make_opt(reference), batch)
    finally:
        engine.shutdown()


def test_killing_a_host_actor_mid_step_raises_naming_the_stage():
    with ray_cluster(num_hosts=2, devices_per_host=4):
        torch.manual_seed(0)
        model = BoundaryMLP(width=512, depth=4)
        batch = (torch.randn(512, 512), torch.randn(512, 512))
        stage_option = torchpar.ManualStageOption(forward_stage_layer_ids=((0, 1), (2, 3)),
                                                  submesh_physical_shapes=((1, 4), (1, 4)),
                                                  submesh_logical_shapes=((1, 4), (1, 4)))
        method = torchpar.PipeshardParallel(num_micro_batches=16, layer_option="manual", stage_option=stage_option)
        engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.01), example_batch=batch,
                                  method=method)
        engine.step(batch)  # warm up: compiled and running
        victim = engine.executor.actors[1]
        killer = threading.Timer(0.3, lambda: __import__("ray").kill(victim))
        start = time.monotonic()
        killer.start()
        with pytest.raises(RuntimeError, match=r"stage\(s\) \[1\]"):
            for _ in range(20):  # the kill lands inside one of these steps
                engine.step(batch)
        assert time.monotonic() - start < 60


def test_memory_stats_are_per_stage_and_executable(runtime):
    model, batch, layer_option, stage_option = _build("mlp", "manual", 2)
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.05), example_batch=batch,
                              method=torchpar.PipeshardParallel(num_micro_batches=2, layer_option=layer_option,
                                                                stage_option=stage_option))
    try:
        engine.step(batch)
        stats = engine.memory_stats()
        assert list(stats) == [0, 1]  # keyed by stage index
        stage_param_bytes = 2 * (32 * 32 + 32) * 4  # two Linear(32, 32) layers per stage
        for stage in stats.values():
            assert set(stage) == {f"{e}_{f}_bytes" for e in ("forward", "backward")
                                  for f in ("argument", "output", "alias", "temp", "generated_code")}
            # parameters (sharded at most over the stage's 4 devices) enter the forward; gradients leave the backward
            assert stage["forward_argument_bytes"] >= stage_param_bytes // 4
            assert stage["backward_output_bytes"] >= stage_param_bytes // 4
    finally:
        engine.shutdown()


class DropoutBoundaryMLP(BoundaryMLP):
    """BoundaryMLP with dropout after each layer: every stage reads the step's PRNG key."""

    def forward(self, x, y):
        for index, layer in enumerate(self.layers):
            x = torch.nn.functional.dropout(torch.relu(layer(x)), p=0.1, training=self.training)
            if index < len(self.layers) - 1:
                x = torchpar.mark_pipeline_boundary(x)
        return torch.nn.functional.mse_loss(x, y)


def test_memory_stats_and_hlo_of_stages_on_one_device_each():
    # stage 1 runs on device 1, not on the process's default device, and reads the (uncommitted) step key
    with local_cluster(num_hosts=2, devices_per_host=1):
        torch.manual_seed(0)
        model = DropoutBoundaryMLP(width=16, depth=2)
        batch = (torch.randn(8, 16), torch.randn(8, 16))
        one_device = ((1, 1), (1, 1))
        stage_option = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                                  submesh_physical_shapes=one_device, submesh_logical_shapes=one_device)
        method = torchpar.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=stage_option)
        with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.05), example_batch=batch,
                              method=method) as engine:
            assert [stage.device_ids for stage in engine.plan.stages] == [[0], [1]]
            engine.step(batch)
            stats = engine.memory_stats()
            assert isinstance(stats, dict) and list(stats) == [0, 1]
            for stage in stats.values():  # one Linear(16, 16) per stage enters its forward, unsharded
                assert stage["forward_argument_bytes"] >= (16 * 16 + 16) * 4
                assert stage["backward_output_bytes"] >= (16 * 16 + 16) * 4
            assert [hlo.startswith("HloModule") for hlo in engine.hlo_text()] == [True, True]


def test_a_smaller_last_batch_recompiles_the_stages_and_matches_pytorch():
    with local_cluster(num_hosts=2, devices_per_host=1):
        torch.manual_seed(0)
        model = BoundaryMLP(width=16, depth=2)
        reference = copy.deepcopy(model)
        make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
        full, last = (torch.randn(8, 16), torch.randn(8, 16)), (torch.randn(4, 16), torch.randn(4, 16))
        one_device = ((1, 1), (1, 1))
        stage_option = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                                  submesh_physical_shapes=one_device, submesh_logical_shapes=one_device)
        method = torchpar.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=stage_option)
        ref_opt = make_opt(reference)
        with torchpar.compile(model, make_opt(model), example_batch=full, method=method) as engine:
            for batch in (full, last, full):  # an epoch ending in a smaller batch, then the next epoch
                ref_opt.zero_grad()
                loss = reference(*batch)
                loss.backward()
                ref_opt.step()
                assert engine.step(batch) == pytest.approx(loss.item(), rel=LOSS_RTOL)
            assert engine.compiled_signatures == 2
            with pytest.raises(ValueError, match=r"batch size 5 is not a multiple of num_micro_batches=2(?s:.*)"
                                                 r"drop_last=True"):
                engine.step((torch.randn(5, 16), torch.randn(5, 16)))
            engine.sync_to_torch()
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(q, p, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


def test_a_searched_micro_batch_count_trains_as_pytorch():
    """``num_micro_batches="auto"``: compile plans the counts dividing the batch's 256 rows and keeps the fastest that
    fits. Under a memory budget one micro-batch of 256 rows cannot have (an eighth of the way from what 8
    micro-batches need to what 1 needs) the count chosen is above 1, and the step cuts every batch into that many
    micro-batches: the losses and weights are PyTorch's on the whole batch."""
    torch.manual_seed(0)
    model = BoundaryMLP(width=64, depth=2)
    reference = copy.deepcopy(model)
    # SGD: Adam's update of an element whose gradient is ~0 is ±lr whatever its size, so 256 micro-batches' summation
    # order would decide its sign
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    batch = (torch.randn(256, 64), torch.randn(256, 64))

    def method(count):
        return torchpar.PipeshardParallel(num_micro_batches=count, layer_option="manual")

    def peak(count) -> float:
        plan = torchpar.plan(model, make_opt(model), example_batch=batch, method=method(count), explain=False)
        return max(stage.estimated_memory_bytes for stage in plan.stages)

    with local_cluster(num_hosts=2, devices_per_host=2):
        one, eight = peak(1), peak(8)
    with local_cluster(num_hosts=2, devices_per_host=2, device_memory_bytes=int(eight + (one - eight) / 8)):
        ref_opt = make_opt(reference)
        with torchpar.compile(model, make_opt(model), example_batch=batch, method=method("auto")) as engine:
            record = engine.plan.solver["micro_batches"]
            assert [row["count"] for row in record["tried"]][:2] == [256, 128]  # the most micro-batches first
            assert engine.plan.num_micro_batches == record["chosen"] > 1
            chosen = next(row for row in record["tried"] if row["count"] == record["chosen"])
            assert chosen["estimated_step_s"] == pytest.approx(engine.plan.estimated_step_s, rel=1e-9)
            for _ in range(3):
                ref_opt.zero_grad()
                loss = reference(*batch)
                loss.backward()
                ref_opt.step()
                assert engine.step(batch) == pytest.approx(loss.item(), rel=LOSS_RTOL)
            engine.sync_to_torch()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
