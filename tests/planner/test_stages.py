"""The inter-op stage DP, submeshes, the analytic stage cost, uniform and manual stages
(torchpar/planner/pipeline/stages.py)."""

import itertools
import math

import numpy as np
import pytest

from torchpar.capture.export import capture_train_step
from torchpar.cluster import ClusterSpec
from torchpar.harness import zoo
from torchpar.planner.pipeline.layers import cluster_layers
from torchpar.planner.sharding.ilp import AboveCutoff
from torchpar.planner.pipeline.stages import (
    AnalyticStageCost,
    StageCost,
    assign_devices,
    logical_mesh_shapes,
    manual_stages,
    pipeline_latency,
    stage_dp,
    submesh_shapes,
    uniform_stages,
)


def linear_cost(work, overhead=0.2):
    """Perfectly split compute plus a per-device overhead: pipelining pays off, and so do balanced stages."""

    def cost(first, last, submesh, logical):
        devices = submesh[0] * submesh[1]
        return StageCost(latency_s=sum(work[first:last + 1]) / devices + overhead * (devices - 1), memory_bytes=0.0)

    return cost


def random_cost(seed, num_layers):
    """Latency and memory that depend on the layers, the submesh and the logical mesh in irregular ways, with a
    per-device overhead large enough that pipelines of several stages often win."""
    rng = np.random.default_rng(seed)
    work = rng.uniform(0.5, 3.0, num_layers)
    params = rng.uniform(1.0, 4.0, num_layers) * 1e9  # bytes
    activations = rng.uniform(0.5, 2.0, num_layers) * 1e9
    skew = {}

    def cost(first, last, submesh, logical):
        devices = submesh[0] * submesh[1]
        key = (first, last, submesh, logical)
        skew.setdefault(key, rng.uniform(0.5, 3.0))
        return StageCost(latency_s=work[first:last + 1].sum() / devices + skew[key] * (devices - 1),
                         memory_bytes=params[first:last + 1].sum() / logical[1],
                         activation_bytes=activations[first:last + 1].sum() / devices)

    return cost


def brute_force(num_layers, hosts, per_host, micro_batches, cost, budget):
    """Every contiguous split × every submesh assignment that uses all devices × the best fitting logical mesh."""
    submeshes = submesh_shapes(hosts, per_host)
    best = math.inf
    for cuts in itertools.product((False, True), repeat=num_layers - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), num_layers]
        ranges = list(zip(bounds, bounds[1:]))
        for assignment in itertools.product(submeshes, repeat=len(ranges)):
            if sum(h * d for h, d in assignment) != hosts * per_host:
                continue
            latencies = []
            for position, ((start, end), submesh) in enumerate(zip(ranges, assignment)):
                in_flight = min(len(ranges) - position, micro_batches)
                fitting = [c.latency_s for c in (cost(start, end - 1, submesh, m) for m in logical_mesh_shapes(submesh))
                           if c.peak_bytes(in_flight) <= budget]
                if not fitting:
                    break
                latencies.append(min(fitting))
            else:
                best = min(best, pipeline_latency(latencies, micro_batches))
    return best


def test_submesh_and_logical_shapes():
    assert submesh_shapes(2, 4) == ((1, 1), (1, 2), (1, 4), (2, 4))
    assert submesh_shapes(1, 8) == ((1, 1), (1, 2), (1, 4), (1, 8))
    assert submesh_shapes(2, 6) == ((1, 1), (1, 2), (1, 6), (2, 6))  # (1, 4) could not tile 6-device hosts
    assert logical_mesh_shapes((2, 4)) == ((1, 8), (2, 4), (4, 2), (8, 1))
    assert logical_mesh_shapes((1, 1)) == ((1, 1),)


def test_assign_devices_tiles_the_cluster():
    assert assign_devices([(1, 2), (1, 2), (1, 4)], 2, 4) == ((0, 1), (2, 3), (4, 5, 6, 7))
    placed = assign_devices([(1, 2), (1, 4), (1, 2)], 2, 4)  # not in order: packed
    assert sorted(d for devices in placed for d in devices) == list(range(8))
    assert all(len({d // 4 for d in devices}) == 1 for devices in placed)  # a (1, k) submesh stays on one host
    with pytest.raises(ValueError, match="tile"):
        assign_devices([(1, 3), (1, 3), (1, 2)], 2, 4)  # 8 devices, but 3+3 cannot share a 4-device host
    with pytest.raises(ValueError, match="hold 6 devices"):
        assign_devices([(1, 2), (1, 4)], 2, 4)


def test_heavy_layer_gets_more_devices():
    work = [1.0, 1.0, 4.0, 1.0]
    for hosts, per_host in ((1, 8), (2, 4)):
        result = stage_dp(4, hosts, per_host, 8, linear_cost(work), memory_budget=1.0)
        heavy = next(s for s in result.stages if s.first_layer <= 2 <= s.last_layer)
        others = [s for s in result.stages if s is not heavy]
        # a stage of its own, and more devices than any other stage
        assert heavy.layers == (2,) and all(heavy.num_devices > s.num_devices for s in others)
        assert sum(s.num_devices for s in result.stages) == 8


def test_equal_layers_give_equal_stages():
    for num_layers, hosts, per_host in ((4, 1, 8), (4, 2, 4), (8, 2, 4)):
        result = stage_dp(num_layers, hosts, per_host, 8, linear_cost([1.0] * num_layers), memory_budget=1.0)
        assert len({len(s.layers) for s in result.stages}) == 1
        assert len({s.submesh for s in result.stages}) == 1
        assert len(result.stages) > 1
        assert [l for s in result.stages for l in s.layers] == list(range(num_layers))


def test_objective_is_the_pipeline_latency_of_the_returned_stages():
    result = stage_dp(6, 2, 4, 8, random_cost(0, 6), memory_budget=math.inf)
    latencies = [s.latency_s for s in result.stages]
    assert result.cost_s == pytest.approx(sum(latencies) + 7 * max(latencies))
    assert all(other.cost_s >= result.cost_s for other in result.runners_up)
    assert len({str(p) for p in (result.best, *result.runners_up)}) == 1 + len(result.runners_up)
    assert "stage 0" in result.summary()
    assert result.dp_s > 0


@pytest.mark.parametrize("seed", range(8))
def test_dp_with_early_stop_matches_brute_force(seed):
    """Random instances, with memory budgets that rule out some (stage, logical mesh, in-flight count)
    choices, or all: the DP (t_max early stop, merged stage counts) finds the brute-force optimum."""
    rng = np.random.default_rng(100 + seed)
    hosts, per_host = [(1, 4), (2, 2), (1, 8), (2, 4)][seed % 4]
    num_layers = int(rng.integers(2, 6))
    micro_batches = int(rng.integers(1, 6))
    cost = random_cost(seed, num_layers)
    for budget in (5e9, 8e9, math.inf):
        expected = brute_force(num_layers, hosts, per_host, micro_batches, cost, budget)
        if not math.isfinite(expected):
            with pytest.raises(ValueError, match="smallest needs"):
                stage_dp(num_layers, hosts, per_host, micro_batches, cost, budget)
            continue
        result = stage_dp(num_layers, hosts, per_host, micro_batches, cost, budget)
        assert result.cost_s == pytest.approx(expected, rel=1e-12)
        assert all(s.memory_bytes <= budget for s in result.stages)
        assert result.num_t_max_tried <= result.num_t_max_candidates


def test_early_stop_prunes_t_max():
    result = stage_dp(8, 2, 4, 16, linear_cost([1.0] * 8), memory_budget=1.0)
    assert result.num_t_max_tried < result.num_t_max_candidates


def test_memory_infeasible_names_the_smallest_budget():
    cost = random_cost(7, 4)
    with pytest.raises(ValueError, match="smallest needs") as error:
        stage_dp(4, 1, 4, 4, cost, memory_budget=1e8)
    need = float(str(error.value).split("(")[1].split(" bytes")[0])
    stage_dp(4, 1, 4, 4, cost, memory_budget=need * (1 + 1e-9))  # fits exactly at the reported need
    with pytest.raises(ValueError):
        stage_dp(4, 1, 4, 4, cost, memory_budget=need * (1 - 1e-6))


def test_uniform_stages():
    partition = uniform_stages(6, 4, 2, 4)
    assert partition.forward_stage_layer_ids == ((0, 1), (2, 3), (4,), (5,))
    assert partition.submesh_physical_shapes == ((1, 2),) * 4
    assert uniform_stages(8, 2, 2, 4).submesh_physical_shapes == ((1, 4), (1, 4))
    assert uniform_stages(8, 1, 2, 4).submesh_physical_shapes == ((2, 4),)
    assert len(uniform_stages(4, None, 2, 4).stages) == 4
    priced = uniform_stages(4, 2, 1, 8, cost=linear_cost([1.0] * 4), num_micro_batches=4)
    assert priced.cost_s == pytest.approx((2 + 4 - 1) * (2 / 4 + 0.2 * 3))  # (S + B − 1)·t
    with pytest.raises(ValueError, match="equal submeshes"):
        uniform_stages(6, 3, 2, 4)
    with pytest.raises(ValueError, match="between 1 and"):
        uniform_stages(2, 4, 2, 4)


def test_manual_stages_validation():
    ok = manual_stages([[0, 1], [2]], [(1, 4), (1, 4)], [(2, 2), (1, 4)], num_layers=3, cluster_hosts=2,
                       devices_per_host=4)
    assert ok.submesh_logical_shapes == ((2, 2), (1, 4))
    chosen = manual_stages([[0, 1], [2]], [(1, 4), (1, 4)], None, num_layers=3, cluster_hosts=1, devices_per_host=8,
                           cost=linear_cost([1.0] * 3))
    assert chosen.stages[0].latency_s > 0
    bad = [
        (([[0], [2, 1]], [(1, 4), (1, 4)], None), "consecutive"),
        (([[0], [2]], [(1, 4), (1, 4)], None), "cover layers"),
        (([[0, 1], [2]], [(1, 4), (1, 2)], None), "tile it exactly"),
        (([[0, 1], [2]], [(1, 4), (1, 4)], [(2, 2), (2, 4)]), "logical mesh"),
        (([[0, 1], [2]], [(1, 4)], None), "one submesh"),
        (([[0, 1], [2]], [(1, 4), (2, 2)], None), "whole hosts"),
    ]
    for (layers, physical, logical), message in bad:
        with pytest.raises(ValueError, match=message):
            manual_stages(layers, physical, logical, num_layers=3, cluster_hosts=2, devices_per_host=4)


@pytest.fixture(scope="module")
def gpt2():
    model, batch = zoo.build("gpt2", {"n_layer": 2}, batch_size=8, seq_len=16)
    graph = capture_train_step(model, batch).graph
    return graph, cluster_layers(graph, 4)


def model_width(graph) -> int:
    """GPT-2's hidden size, from its token embedding's shape."""
    return next(i.meta.shape[1] for i in graph.inputs if i.target == "transformer.wte.weight")


def test_analytic_cost_formulas(gpt2):
    graph, layering = gpt2
    cluster = ClusterSpec(num_hosts=1, devices_per_host=8)
    cost = AnalyticStageCost(layering, graph, cluster, num_micro_batches=4, optimizer_state_copies=2)
    last = layering.num_layers - 1
    one = cost(0, last, (1, 1), (1, 1))
    assert one.communication_s == 0.0
    assert one.compute_s == pytest.approx(3 * sum(layering.flops) / cluster.device_flops)
    params = cost.parameter_bytes(0, last)
    assert params == sum({i.target: i.meta.nbytes for i in graph.inputs if i.kind == "param"}.values())
    assert one.memory_bytes >= 4 * params  # weights + grads + 2 Adam moments
    # tied embedding / LM head weight: counted in every stage that reads it
    wte = next(i.meta.nbytes for i in graph.inputs if i.target == "transformer.wte.weight")
    assert cost.parameter_bytes(0, 0) + cost.parameter_bytes(1, last) >= params + wte
    # data parallel: gradient all-reduce once per step, spread over the micro-batches
    data = cost(0, last, (1, 8), (8, 1))
    fewer = AnalyticStageCost(layering, graph, cluster, num_micro_batches=1, optimizer_state_copies=2)(
        0, last, (1, 8), (8, 1))
    assert data.compute_s == pytest.approx(one.compute_s / 8)
    assert data.communication_s == pytest.approx(fewer.communication_s / 4)
    assert data.activation_bytes == pytest.approx(one.activation_bytes / 8)
    # tensor parallel: one all-reduce of the hidden states per weight matmul (4 per GPT-2 block, 1 for the LM head)
    tensor = cost(0, last, (1, 8), (1, 8))
    hidden = next(i.meta.nbytes for i in graph.inputs if i.kind == "input") // 8 * 4 * model_width(graph)
    from torchpar.planner.mesh_links import stage_mesh
    ar = stage_mesh((1, 8), cluster, (1, 8)).all_reduce(hidden, [1])
    parts = AnalyticStageCost(layering, graph, cluster, num_micro_batches=10**9, optimizer_state_copies=2)
    assert parts(0, last, (1, 8), (1, 8)).communication_s == pytest.approx((2 * 4 + 1) * ar, rel=1e-6)
    assert tensor.communication_s > (2 * 4 + 1) * ar
    # a data axis the micro-batch's 8 rows do not divide is no data parallelism: not a candidate
    assert cost.micro_batch_rows == 8
    assert cost(0, last, (2, 8), (16, 1)).latency_s == math.inf and cost(0, last, (2, 8), (8, 2)).latency_s < math.inf
    # tensor parallel shards the state, data parallel replicates it; both shard the backward's working set
    from torchpar.planner.remat import BACKWARD_WORKING_COPIES, materialized

    live = materialized(graph)
    working = BACKWARD_WORKING_COPIES * max(n.out_bytes for n in graph.nodes if n.name in live)
    assert cost(0, last, (1, 8), (1, 8)).memory_bytes == pytest.approx(one.memory_bytes / 8)
    assert data.memory_bytes == pytest.approx(one.memory_bytes - working + working / 8)
    with pytest.raises(ValueError):
        cost(0, last, (1, 8), (2, 2))


def test_analytic_cost_offers_weights_sharded_over_the_data_axis_too(gpt2):
    """``options`` on an ``(a > 1, b > 1)`` mesh: the stage with weights' state also split over axis 0 (ZeRO-3 / FSDP
    inside tensor parallelism) — each weight saves ``P_w·(2 + 2)·(1 − 1/a)/b`` bytes for one all-gather ``AG_0(P_w/b)``
    per micro-batch. Without it the screening read a (32, 8) stage of Llama-3 70B as over memory and took (8, 32) at
    2.2× the step. The ILP reaches that memory: it fits the last option's budget by splitting weights over both axes."""
    from torchpar.planner.intra_op import StageProblem, plan_stage
    from torchpar.planner.mesh_links import stage_mesh

    graph, layering = gpt2
    cluster = ClusterSpec(num_hosts=2, devices_per_host=4)
    cost = AnalyticStageCost(layering, graph, cluster, num_micro_batches=1, optimizer_state_copies=2)
    last = layering.num_layers - 1
    plain, *sharded = cost.options(0, last, (2, 4), (2, 4))
    assert plain == cost(0, last, (2, 4), (2, 4)) and len(sharded) == 4
    assert cost.options(0, last, (2, 4), (1, 8)) == (cost(0, last, (2, 4), (1, 8)),)  # no data axis: nothing to split
    memories = [plain.memory_bytes] + [option.memory_bytes for option in sharded]
    latencies = [plain.latency_s] + [option.latency_s for option in sharded]
    assert memories == sorted(memories, reverse=True) and latencies == sorted(latencies)
    _, weights = cost._weight_arrays(0, last)
    assert plain.memory_bytes - sharded[-1].memory_bytes == pytest.approx(weights.sum() * 4 * (1 - 1 / 2) / 4)
    mesh = stage_mesh((2, 4), cluster, (2, 4))
    gathers = sum(mesh.all_gather(w / 4, [0]) for w in weights)
    assert sharded[-1].communication_s - plain.communication_s == pytest.approx(gathers)
    assert sharded[-1].compute_s == plain.compute_s
    budget = 1.05 * sharded[-1].peak_bytes(1)
    assert plain.peak_bytes(1) > budget
    problem = StageProblem(kind="shard", cluster=cluster, trainable={i.target for i in graph.inputs if i.kind == "param"},
                           optimizer_state_copies=2.0, submesh=(2, 4))
    result = plan_stage(graph, problem, (2, 4), budget)
    assert result.stage.estimated_memory_bytes <= budget
    assert any({0, 1} <= {axis for entry in spec if entry for axis in entry} for spec in result.stage.params.values())


def test_stage_dp_on_gpt2_layers(gpt2):
    graph, layering = gpt2
    cluster = ClusterSpec(num_hosts=2, devices_per_host=4)
    cost = AnalyticStageCost(layering, graph, cluster, num_micro_batches=8, optimizer_state_copies=2)
    result = stage_dp(layering.num_layers, 2, 4, 8, cost, cluster.device_memory_bytes)
    assert [l for s in result.stages for l in s.layers] == list(range(layering.num_layers))
    assigned = assign_devices(result.best.submesh_physical_shapes, 2, 4)
    assert sorted(d for devices in assigned for d in devices) == list(range(8))
    assert result.cost_s == pytest.approx(pipeline_latency([s.latency_s for s in result.stages], 8))


# --- the schedules of issue 12: step formulas, in-flight counts and interleaved stage layouts -------------

@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("gpipe", 1), ("zb_h1", 1), ("interleaved_1f1b", 2),
                                              ("interleaved_1f1b", 3)])
@pytest.mark.parametrize("groups,micro", [(2, 4), (4, 8), (4, 16)])
def test_pipeline_latency_is_the_simulated_makespan_on_equal_stages(schedule, virtual, groups, micro):
    from torchpar.planner.pipeline.schedules import make_schedule, simulate

    t = 3.0 / virtual  # each stage: one micro-batch's forward + backward, in thirds F, B, W
    stages = groups * virtual
    simulated = simulate(make_schedule(schedule, stages, micro, virtual_stages=virtual), t / 3, 2 * t / 3,
                         weight_time=t / 3)
    assert pipeline_latency([t] * stages, micro, schedule, virtual) == pytest.approx(simulated.makespan)


def test_micro_batches_in_flight_per_schedule():
    from torchpar.planner.pipeline.stages import micro_batches_in_flight
    from torchpar.planner.pipeline.schedules import interleaved_one_f_one_b, stage_in_flight

    assert micro_batches_in_flight(4, 8, "1f1b") == [4, 3, 2, 1]
    assert micro_batches_in_flight(4, 8, "zb_h1") == [4, 4, 4, 4]
    assert micro_batches_in_flight(4, 2, "zb_h1") == [2, 2, 2, 2]
    assert micro_batches_in_flight(8, 8, "interleaved_1f1b", 2) == stage_in_flight(interleaved_one_f_one_b(4, 8, 2))
    with pytest.raises(ValueError, match="do not split"):
        micro_batches_in_flight(6, 8, "interleaved_1f1b", 4)


def test_uniform_and_manual_interleaved_stages():
    partition = uniform_stages(8, None, 1, 4, virtual_stages=2, schedule="interleaved_1f1b", num_micro_batches=4)
    assert len(partition.stages) == 8 and all(s.submesh == (1, 1) for s in partition.stages)
    assert partition.forward_stage_layer_ids == tuple((s,) for s in range(8))
    partition = uniform_stages(8, 2, 1, 4, virtual_stages=2, schedule="interleaved_1f1b", num_micro_batches=4)
    assert [s.submesh for s in partition.stages] == [(1, 2)] * 4
    with pytest.raises(ValueError, match="device group"):
        uniform_stages(4, 4, 1, 4, virtual_stages=2)
    layers = tuple((s,) for s in range(4))
    ok = manual_stages(layers, ((1, 2),) * 4, None, num_layers=4, cluster_hosts=1, devices_per_host=4,
                       schedule="interleaved_1f1b", num_micro_batches=2, virtual_stages=2)
    assert ok.virtual_stages == 2 and ok.schedule == "interleaved_1f1b"
    with pytest.raises(ValueError, match="repeat with period 2"):
        manual_stages(layers, ((1, 2), (1, 2), (1, 1), (1, 3)), None, num_layers=4, cluster_hosts=1,
                      devices_per_host=4, schedule="interleaved_1f1b", num_micro_batches=2, virtual_stages=2)


def test_pipeshard_schedule_options():
    import torchpar

    assert torchpar.PipeshardParallel(schedule="interleaved_1f1b").virtual_stages == 2
    assert torchpar.PipeshardParallel(schedule="interleaved_1f1b", virtual_stages=3).virtual_stages == 3
    assert torchpar.PipeshardParallel(schedule="zb_h1").virtual_stages is None
    with pytest.raises(ValueError, match="needs schedule='interleaved_1f1b'"):
        torchpar.PipeshardParallel(schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="is schedule='1f1b'"):
        torchpar.PipeshardParallel(schedule="interleaved_1f1b", virtual_stages=1)
    with pytest.raises(ValueError, match="schedule must be one of"):
        torchpar.PipeshardParallel(schedule="zb_h2")


# --- the interleaved-1F1B stage DP (torchpar/planner/pipeline/interleaved_stages.py) --------------------------------

def brute_force_interleaved(num_layers, hosts, per_host, micro_batches, cost, budget, virtual):
    """Every number of equal device groups G × every cut into v·G contiguous stages × each stage's best logical
    mesh within budget / v at its schedule position's in-flight count."""
    from torchpar.planner.pipeline.stages import _uniform_submesh, micro_batches_in_flight

    devices, best = hosts * per_host, math.inf
    for groups in range(1, devices + 1):
        submesh = _uniform_submesh(devices // groups, per_host) if devices % groups == 0 else None
        count = groups * virtual
        if submesh is None or count > num_layers or micro_batches % groups:
            continue
        in_flight = micro_batches_in_flight(count, micro_batches, "interleaved_1f1b", virtual)
        for cuts in itertools.combinations(range(1, num_layers), count - 1):
            bounds = [0, *cuts, num_layers]
            latencies = []
            for position, (start, end) in enumerate(zip(bounds, bounds[1:])):
                fitting = [c.latency_s for c in (cost(start, end - 1, submesh, m) for m in logical_mesh_shapes(submesh))
                           if c.peak_bytes(in_flight[position]) <= budget / virtual]
                if not fitting:
                    break
                latencies.append(min(fitting))
            else:
                best = min(best, pipeline_latency(latencies, micro_batches, "interleaved_1f1b", virtual))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_interleaved_dp_matches_brute_force(seed):
    """Random instances and budgets that rule out some choices or all: the interleaved DP (per group count,
    t_max early stop) finds the brute-force optimum, its stages repeat one submesh, and each fits its share."""
    from torchpar.planner.pipeline.interleaved_stages import interleaved_stage_dp

    rng = np.random.default_rng(200 + seed)
    hosts, per_host = [(1, 4), (2, 2), (1, 8)][seed % 3]
    virtual = 2 + seed % 2
    num_layers = int(rng.integers(virtual * 2, 9))
    micro_batches = [4, 8][seed % 2]
    cost = random_cost(seed, num_layers)
    for budget in (8e9, 2e10, math.inf):
        expected = brute_force_interleaved(num_layers, hosts, per_host, micro_batches, cost, budget, virtual)
        if not math.isfinite(expected):
            with pytest.raises(ValueError, match="smallest needs"):
                interleaved_stage_dp(num_layers, hosts, per_host, micro_batches, cost, budget, virtual_stages=virtual)
            continue
        result = interleaved_stage_dp(num_layers, hosts, per_host, micro_batches, cost, budget,
                                      virtual_stages=virtual)
        assert result.cost_s == pytest.approx(expected, rel=1e-12)
        best = result.best
        assert best.schedule == "interleaved_1f1b" and best.virtual_stages == virtual
        assert len(best.stages) % virtual == 0 and len({s.submesh for s in best.stages}) == 1
        assert all(s.memory_bytes <= budget / virtual for s in best.stages)
        assert [l for s in best.stages for l in s.layers] == list(range(num_layers))


def test_interleaved_dp_errors_say_what_to_change():
    from torchpar.planner.pipeline.interleaved_stages import interleaved_stage_dp

    with pytest.raises(ValueError, match="no number of equal device groups"):
        interleaved_stage_dp(3, 1, 4, 4, linear_cost([1.0] * 3), None, virtual_stages=4)  # 4·G stages > 3 layers
    with pytest.raises(ValueError, match="virtual_stages ≥ 2"):
        interleaved_stage_dp(8, 1, 4, 4, linear_cost([1.0] * 8), None, virtual_stages=1)
    cost = random_cost(3, 6)
    with pytest.raises(ValueError, match="smallest needs") as error:
        interleaved_stage_dp(6, 1, 4, 4, cost, 1e8, virtual_stages=2)
    need = float(str(error.value).split("(")[1].split(" bytes")[0])
    interleaved_stage_dp(6, 1, 4, 4, cost, need * (1 + 1e-9), virtual_stages=2)  # fits exactly at the reported need


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("seed", range(6))
def test_the_bounded_t_max_search_finds_the_scans_optimum_with_fewer_dps(seed, schedule):
    """Branch and bound over t_max (what large clusters use): tolerance 0 gives the scan's optimum exactly,
    tolerance 1% stays within 1% of it; both solve fewer DPs than the scan on instances with many candidates."""
    rng = np.random.default_rng(300 + seed)
    hosts, per_host = [(2, 4), (4, 4), (2, 8)][seed % 3]
    num_layers = int(rng.integers(4, 9))
    micro_batches = int(rng.integers(2, 32))
    cost = random_cost(seed, num_layers)
    for budget in (8e9, math.inf):
        try:
            scan = stage_dp(num_layers, hosts, per_host, micro_batches, cost, budget, schedule=schedule, search="scan")
        except ValueError:
            continue
        exact = stage_dp(num_layers, hosts, per_host, micro_batches, cost, budget, schedule=schedule, search="bound")
        loose = stage_dp(num_layers, hosts, per_host, micro_batches, cost, budget, schedule=schedule, search="bound",
                         tolerance=0.01)
        assert exact.cost_s == pytest.approx(scan.cost_s, rel=1e-12)
        assert scan.cost_s <= loose.cost_s <= scan.cost_s * 1.01
        assert loose.num_t_max_tried <= exact.num_t_max_tried <= exact.num_t_max_candidates


# --- mixture-of-experts stages: the token exchange and the replicated-dense option (issue 47) ----------------

@pytest.fixture(scope="module")
def mixtral():
    model, batch = zoo.build("mixtral", {"num_hidden_layers": 2, "num_local_experts": 8}, batch_size=16, seq_len=16)
    graph = capture_train_step(model, batch).graph
    return graph, cluster_layers(graph, 2)


def _routed_layer(layering, graph) -> int:
    from torchpar.ir.op_families import GROUPED_MATMULS

    return next(layering.layer_of[n.name] for n in graph.nodes if n.target in GROUPED_MATMULS)


def test_analytic_cost_prices_the_expert_exchange(mixtral):
    """A routed layer on ``(1, 8)`` pays at least one grouped matmul's cheapest exchange or all-reduce per
    micro-batch (before: nothing); on ``(8, 1)`` (weights replicated, rows split) only the once-per-step sync."""
    from torchpar.ir.op_families import GROUPED_MATMULS
    from torchpar.planner.mesh_links import stage_mesh
    from torchpar.planner.sharding.strategies import expert_strategies

    graph, layering = mixtral
    layer = _routed_layer(layering, graph)
    cluster = ClusterSpec(num_hosts=1, devices_per_host=8)
    per_step = AnalyticStageCost(layering, graph, cluster, num_micro_batches=10**9, optimizer_state_copies=2)
    assert per_step(layer, layer, (1, 8), (8, 1)).communication_s < 1e-10  # the sync, over 10⁹ micro-batches
    metas = graph.metas()
    node = next(n for n in graph.nodes if n.target in GROUPED_MATMULS and layering.layer_of[n.name] == layer)
    shapes = [metas[r].shape for r in list(node.refs())[:3]]
    mesh = stage_mesh((1, 8), cluster, (1, 8))
    exchange = min(s.comm_s for s in expert_strategies(shapes, node.flops, 4, (True, False, False), mesh))
    all_reduce = mesh.all_reduce(min(node.out_bytes, metas[next(node.refs())].nbytes), [1])
    assert per_step(layer, layer, (1, 8), (1, 8)).communication_s > min(exchange, all_reduce) > 0


def test_analytic_cost_offers_experts_split_beside_replicated_dense_weights(mixtral):
    """``options``: on ``(1, 8)`` a routed stage also offers its other weights replicated — no tensor-parallel
    all-reduce, their weights, gradients and Adam moments whole on every device (``(2 + 2)·(1 − 1/8)`` more bytes
    of each); ``(8, 1)`` offers no such variant."""
    graph, layering = mixtral
    layer = _routed_layer(layering, graph)
    cluster = ClusterSpec(num_hosts=1, devices_per_host=8)
    cost = AnalyticStageCost(layering, graph, cluster, num_micro_batches=4, optimizer_state_copies=2)
    plain, replicated = cost.options(layer, layer, (1, 8), (1, 8))
    assert plain == cost(layer, layer, (1, 8), (1, 8))
    assert replicated.communication_s < plain.communication_s
    assert replicated.compute_s == pytest.approx(plain.compute_s)
    read = {r for n in graph.nodes if layering.layer_of[n.name] == layer for r in n.refs()}
    params = {i.target: i.meta.nbytes for i in graph.inputs if i.kind == "param" and i.name in read}
    experts = sum(nbytes for target, nbytes in params.items() if target.endswith(("gate_up_proj", "down_proj")))
    assert 0 < experts < cost.parameter_bytes(layer, layer) == sum(params.values())
    dense = sum(params.values()) - experts
    assert replicated.memory_bytes - plain.memory_bytes == pytest.approx(dense * 4 * (1 - 1 / 8))
    data_parallel = cost.options(layer, layer, (1, 8), (8, 1))  # no replicated-dense variant: only split weights
    assert data_parallel[0] == cost(layer, layer, (1, 8), (8, 1))
    assert all(option.memory_bytes < data_parallel[0].memory_bytes for option in data_parallel[1:])


def test_close_logical_meshes_offers_the_meshes_within_the_tolerance_that_fit():
    """The stage's own mesh first, then the others within ``1 + tolerance`` of its latency that fit, fastest first."""
    from torchpar.planner.pipeline.stages import StageChoice, close_logical_meshes

    latency = {(1, 8): 1.00, (2, 4): 1.04, (4, 2): 1.02, (8, 1): 0.90}
    memory = {(1, 8): 1.0, (2, 4): 2.0, (4, 2): 4.0, (8, 1): 8.0}

    def cost(first, last, submesh, logical):
        return StageCost(latency_s=latency[logical], memory_bytes=memory[logical], activation_bytes=0.5)

    stage = StageChoice(0, 1, (1, 8), (1, 8), 1.0, 1.5)
    assert close_logical_meshes(stage, cost, memory_budget=5.0, in_flight=2) == [(1, 8), (4, 2), (2, 4)]
    assert close_logical_meshes(stage, cost, memory_budget=4.5, in_flight=2) == [(1, 8), (2, 4)]  # (4, 2): 5 bytes
    assert close_logical_meshes(stage, cost, memory_budget=5.0, in_flight=2, tolerance=0.03) == [(1, 8), (4, 2)]
    assert close_logical_meshes(stage, cost, memory_budget=9.0, in_flight=2, tolerance=0.0) == [(1, 8), (8, 1)]


class _Problem:
    """A stand-in for :class:`torchpar.planner.intra_op.PreparedStage`: a bound, and the cost its solve returns."""

    def __init__(self, bound, cost, fits=True):
        self.lower_bound_s, self.cost, self.fits, self.solved, self.probed_s, self.build_s = bound, cost, fits, 0, \
            math.inf, 1.0

    def probe(self, memory_budget, time_limit_s):
        if not self.fits:
            raise ValueError(f"no layout of the {self.cost} s problem fits")
        self.probed_s = self.cost

    final = None

    def solve(self, memory_budget, time_limit_s, give_up=None):
        from types import SimpleNamespace

        self.solved += 1
        if give_up is not None and give_up(self.cost):  # the solver's bound reaches the optimum at last
            raise AboveCutoff(self.cost)
        return SimpleNamespace(stage=SimpleNamespace(estimated_cost_s=self.cost), solver_stats=dict)


def test_a_stage_takes_the_cheapest_logical_mesh_the_ilp_finds():
    from torchpar.planner.pipeline.pipeline_plan import _MeshChoice

    screened, other, hopeless, too_big = _Problem(0.8, 1.0), _Problem(0.7, 0.9), _Problem(0.95, 2.0), \
        _Problem(0.1, 0.2, fits=False)
    choice = _MeshChoice([screened, other, hopeless, too_big])
    assert choice.lower_bound_s == 0.1 and choice.build_s == 4.0
    choice.probe(1.0, 2.0)
    assert choice.alternatives == [screened, other, hopeless]  # the one that does not fit is dropped
    assert choice.probed_s == 0.9 and choice.lower_bound_s == 0.7
    assert choice.solve(1.0, 30.0).stage.estimated_cost_s == 0.9
    assert hopeless.solved == 0  # its bound, 0.95, cannot beat the 0.9 s found: not solved
    with pytest.raises(AboveCutoff) as stopped:  # the caller gives up above 0.85 s: every alternative is above it
        _MeshChoice([_Problem(0.7, 0.9), _Problem(0.8, 1.0)]).solve(1.0, 30.0, give_up=lambda bound: bound > 0.85)
    assert stopped.value.bound_s == 0.9


def test_a_stage_whose_bound_loses_the_partition_stops_its_solve():
    """``_refine`` gives every stage's solve the test "with this bound the partition's step cannot beat the best":
    a solve that proves it stops (:class:`AboveCutoff`) and the partition is pruned with that bound in its step."""
    from torchpar.planner.pipeline.pipeline_plan import _CannotWin, _MeshChoice, _Prepared, _refine

    slow, fast = _Problem(0.4, 0.6), _Problem(0.1, 0.5)
    prepared = _Prepared(partition=None, stage_graphs=[None, None], stage_layers=[[0], [1]], submeshes=[(1, 1)] * 2,
                         devices=[[0], [1]], problems=[_MeshChoice([slow]), _MeshChoice([fast])], step=sum,
                         in_flight=[2, 1])
    with pytest.raises(_CannotWin) as pruned:  # 0.6 + 0.5 > 1.0
        _refine(prepared, memory_budget=1.0, time_limit_s=30.0, beat_s=1.0)
    assert pruned.value.step_s == pytest.approx(1.1) and (slow.solved, fast.solved) == (1, 1)
    assert _refine(prepared, memory_budget=1.0, time_limit_s=30.0, beat_s=1.2).step_s == pytest.approx(1.1)
    with pytest.raises(ValueError, match="fits"):
        _MeshChoice([_Problem(0.1, 0.2, fits=False)]).probe(1.0, 2.0)


@pytest.fixture(scope="module")
def resnet():
    model, batch = zoo.build("resnet", batch_size=8)
    graph = capture_train_step(model, batch).graph
    return graph, cluster_layers(graph, 2)


def test_analytic_cost_prices_convolutions_as_weight_matmuls(resnet):
    """A convolution's weight split over axis 1 costs an all-reduce of its smaller activation, as a weight matmul's
    does (it priced none, and a Wide-ResNet screened as 64-way tensor parallel for free); on ``(8, 1)`` the stage is
    also offered with weights split over all devices, the cheapest per byte saved first: memory falls by ``P_w·(2 +
    optimizer_state_copies)·(1 − 1/8)`` per weight split, and here (every activation larger than its weight's share
    of the gradient sync) the step gets slower with each."""
    from torchpar.planner.mesh_links import stage_mesh
    from torchpar.planner.pipeline.stage_cost import _WEIGHT_MATMULS, _weight_of, _weight_values

    graph, layering = resnet
    cluster = ClusterSpec(num_hosts=1, devices_per_host=8)
    cost = AnalyticStageCost(layering, graph, cluster, num_micro_batches=4, optimizer_state_copies=2)
    metas = graph.metas()
    convolutions = [n for n in graph.nodes if n.target == "aten.convolution.default"]
    last = layering.num_layers - 1
    mesh = stage_mesh((1, 8), cluster, (1, 8))
    exchanged = sum(min(n.out_bytes, metas[next(n.refs())].nbytes) for n in convolutions)
    assert cost(0, last, (1, 8), (1, 8)).communication_s > mesh.all_reduce(exchanged, [1]) - mesh.all_reduce(0.0, [1])
    plain, *split = cost.options(0, last, (1, 8), (8, 1))
    assert plain == cost(0, last, (1, 8), (8, 1)) and len(split) == 4
    memories = [plain.memory_bytes] + [option.memory_bytes for option in split]
    latencies = [plain.latency_s] + [option.latency_s for option in split]
    assert memories == sorted(memories, reverse=True) and latencies == sorted(latencies)
    of_weight = _weight_values(graph)
    split_weights = {of_weight[_weight_of(n, of_weight)] for n in graph.nodes if n.target in _WEIGHT_MATMULS}
    split_bytes = sum(i.meta.nbytes for i in graph.inputs if i.kind == "param" and i.target in split_weights)
    assert len(split_weights) == len(convolutions) + 1  # and the classifier's weight
    assert plain.memory_bytes - split[-1].memory_bytes == pytest.approx(split_bytes * 4 * (1 - 1 / 8))
