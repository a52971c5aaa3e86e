"""Intra-operator plans for one stage: the automatic ILP plan and the hand plans on the same path.

Every plan family is the sharding ILP (:mod:`.sharding.ilp`) on the same solver graph, with some roots
restricted:

- ``shard`` (ShardParallel, the automatic plan): nothing restricted;
- ``data_parallel``: batch inputs split on dim 0 over every mesh axis, parameters replicated;
- ``zero2``: the data-parallel solution, then gradients reduce-scattered and optimizer state sharded;
- ``zero3``: as ``zero2`` with parameters stored sharded and all-gathered where they are read;
- ``megatron``: batch on axis 0; in each repeated block the matmuls with a parameter weight alternate
  column-split / row-split on axis 1 (QKV column, attention-out row, fc1 column, fc2 row), other
  matmuls (e.g. the LM head) column-split. With ``sequence_parallel`` the row-split matmuls reduce-scatter
  their output by rows (tokens) over axis 1 instead of all-reducing it, so the norms, dropout and residual
  adds between them work on a ``1/d1`` share of the tokens and the next column-split matmul all-gathers
  its input (Megatron-LM's sequence parallelism).

Hence the automatic plan's estimated cost is never above a hand plan's on the same mesh.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from torchpar.hardware import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.ir.layout import Spec, is_valid, make_spec, to_json
from torchpar.planner.mesh_links import axes_crossing_hosts, stage_mesh, submesh_of
from torchpar.planner.plan import StagePlan
from torchpar.planner.sharding.comm_bytes import collective_bytes
from torchpar.planner.sharding.cost_model import LogicalMesh
from torchpar.planner.sharding.exchange_strategies import is_exchange
from torchpar.planner.sharding.ilp import AboveCutoff, Solution, evaluate, gathered_memory, solve, transient_peak
from torchpar.planner.sharding.solver_graph import SolverGraph, build_solver_graph
from torchpar.planner.sharding.strategies import Strategy

log = logging.getLogger(__name__)

PlanKind = Literal["shard", "data_parallel", "zero2", "zero3", "megatron"]
PLAN_KINDS: tuple[str, ...] = ("shard", "data_parallel", "zero2", "zero3", "megatron")
"""The one-stage plan families, named as the methods are (:data:`torchpar.methods.METHOD_NAMES`)."""


@dataclass
class IntraOpResult:
    """A solved stage: its plan, the solver graph and solution behind it, and timings."""

    stage: StagePlan
    solver_graph: SolverGraph
    solution: Solution
    communication_s: float
    build_s: float
    rebuild: Callable[[LogicalMesh], SolverGraph] | None = None
    """Builds this stage's solver graph again on another mesh of the same shape (for :meth:`explain`)."""
    mesh_trials: list[dict] = field(default_factory=list)
    """:func:`plan_best_mesh`: every mesh shape tried, ``{"logical_mesh_shape", "estimated_step_s",
    "estimated_memory_bytes", "chosen"}`` or ``{"logical_mesh_shape", "error"}``."""
    extra_collective_bytes: dict[str, float] = field(default_factory=dict)
    """Collectives added after the solve (ZeRO's gathers), by kind, per-device bytes sent."""

    def explain(self) -> None:
        """Fill ``stage.communication_bytes``: per-device bytes sent per step by collective kind
        (:mod:`.sharding.comm_bytes`; a few solver-graph rebuilds, so only where a plan is explained)."""
        if self.rebuild is None:
            return
        sent = collective_bytes(self.rebuild, self.stage.logical_mesh_shape, self.solution.choice)
        for kind, nbytes in self.extra_collective_bytes.items():
            sent[kind] += nbytes
        self.stage.communication_bytes = sent

    def solver_stats(self) -> dict:
        stats = dict(self.solution.stats())
        stats.update(
            roots=len(self.solver_graph.roots),
            edges=len(self.solver_graph.edges),
            strategies=self.solver_graph.num_strategies,
            graph_s=self.build_s,
        )
        return stats


def logical_mesh(shape: tuple[int, int], cluster: ClusterSpec, submesh: tuple[int, int] | None = None) -> LogicalMesh:
    """The logical mesh ``shape`` on ``submesh`` (default: the cluster's first devices), each axis priced with the
    links it crosses (:func:`torchpar.planner.mesh_links.stage_mesh`)."""
    return stage_mesh(shape, cluster, submesh)


def mesh_shapes_for(num_devices: int) -> list[tuple[int, int]]:
    """Every 2-D logical shape of ``num_devices`` devices, 1×N first."""
    return [(a, num_devices // a) for a in range(1, num_devices + 1) if num_devices % a == 0]


@dataclass(frozen=True, kw_only=True)
class StageProblem:
    """What one stage's sharding plan is asked for, beside its graph and logical mesh: passed down whole through
    :func:`plan_best_mesh`, :func:`plan_stage` and :func:`prepare_stage` (``dataclasses.replace`` varies a field)."""

    kind: PlanKind
    """The plan family (:data:`PLAN_KINDS`; the module docstring)."""
    cluster: ClusterSpec
    trainable: frozenset[str]
    """Parameter names that get gradients and optimizer state."""
    optimizer_state_copies: float
    """Optimizer state per trained parameter, in parameter-sized copies (Adam: 2)."""
    submesh: tuple[int, int] | None = None
    """The physical devices the stage runs on (default: the cluster's first devices); it decides which logical axes
    cross hosts."""
    num_micro_batches: int = 1
    """The graph is one micro-batch's step of a step that accumulates this many (priced per step:
    :func:`.sharding.solver_graph.build_solver_graph`)."""
    remat: str = "none"
    """The activation checkpointing the step runs with (``planner.remat.REMAT_OPTIONS``), priced in memory and
    compute."""
    in_flight: int = 1
    """A pipeline stage's micro-batches in flight under its schedule (their activations all held at its peak)."""
    experts: str = "auto"
    """How grouped matmuls may split (``ShardParallel.experts``)."""
    context: str = "auto"
    """Whether attention may split its sequence (``ShardParallel.context``)."""
    sequence_parallel: bool = False
    """The ``megatron`` hand plan's row-split matmuls scatter their output by tokens."""
    per_micro_batch: bool = False
    """A pipeline stage: its estimates are per micro-batch, the step's gradient sync amortized
    (:attr:`PreparedStage.amortized_over`)."""

    def __post_init__(self) -> None:
        if self.kind not in PLAN_KINDS:
            raise ValueError(f"unknown plan kind {self.kind!r}")
        object.__setattr__(self, "trainable", frozenset(self.trainable))


def plan_stage(
    graph: Graph,
    problem: StageProblem,
    mesh_shape: tuple[int, int],
    memory_budget: float | None = None,
    time_limit_s: float = 30.0,
) -> IntraOpResult:
    """Solve ``problem`` for stage ``graph`` on a logical mesh of ``mesh_shape`` placed on ``problem.submesh``
    (CP-SAT stops after ``time_limit_s`` with its best layout)."""
    return prepare_stage(graph, problem, mesh_shape).solve(memory_budget, time_limit_s)


@dataclass
class PreparedStage:
    """A stage's sharding problem, built and not yet solved (:func:`prepare_stage`)."""

    graph: Graph
    kind: PlanKind
    mesh: LogicalMesh
    cluster: ClusterSpec
    submesh: tuple[int, int] | None
    trainable: set[str]
    optimizer_state_copies: float
    solver_graph: SolverGraph
    batch_axes: tuple[int, ...] | None
    build_s: float
    rebuild: Callable[[LogicalMesh], SolverGraph]
    cheapest_s: float
    """Every root at its cheapest strategy and no resharding (edges cost ≥ 0): no solution costs less."""
    sequence_parallel: bool = False
    """The ``megatron`` restrictions with Megatron's sequence parallelism (the module docstring)."""
    amortized_over: int = 1
    """A pipeline stage's ``num_micro_batches`` B: the ILP prices the stage's whole step (B micro-batches, each weight
    gradient synchronized once) and its estimates are that ÷ B, seconds per micro-batch with the step's gradient
    sync amortized, as the pipeline formula (:func:`torchpar.planner.pipeline.stages.pipeline_latency`) and the stage DP
    take them."""

    @property
    def lower_bound_s(self) -> float:
        """A bound no solution beats: :attr:`cheapest_s`, or the bound a :meth:`probe` proved; for ``"shard"`` the
        stage's estimated seconds are the ILP objective (÷ :attr:`amortized_over`), so this bounds
        ``estimated_cost_s``."""
        return max(self.cheapest_s, self.probed_bound_s) / self.amortized_over

    probed_bound_s: float = 0.0
    """The lower bound a :meth:`probe` proved (CP-SAT's, :attr:`.sharding.ilp.Solution.lower_bound_s`)."""
    probed_s: float = math.inf
    """The estimated seconds of the best layout a :meth:`probe` found (∞: none)."""
    final: IntraOpResult | None = None
    """A probe's result when it was optimal: :meth:`solve` returns it."""
    probed_choice: list[int] | None = None
    """The layout a probe found (each root's strategy index): :meth:`solve` starts CP-SAT from it."""

    def probe(self, memory_budget: float | None, time_limit_s: float) -> None:
        """Solve under a short time limit: keep the bound it proves, the best layout it finds, and the result if
        optimal. Raises :class:`.sharding.ilp.MemoryBudgetError` if no layout fits."""
        allowed = _restrictions(self.kind, self.solver_graph, self.batch_axes, self.sequence_parallel)
        solution = solve(
            self.solver_graph,
            memory_budget=memory_budget,
            time_limit_s=time_limit_s,
            allowed=allowed,
            none_if_unsolved=True,
        )
        if solution is None:
            return
        self.probed_bound_s = max(self.probed_bound_s, solution.lower_bound_s)
        self.probed_choice = solution.choice
        result = self._result(solution)
        self.probed_s = result.stage.estimated_cost_s
        if solution.status.startswith(("OPTIMAL", "FORCED")):  # "OPTIMAL (reused)" too
            self.final = result

    def solve(
        self,
        memory_budget: float | None = None,
        time_limit_s: float = 30.0,
        give_up: Callable[[float], bool] | None = None,
    ) -> IntraOpResult:
        """The stage solved to the end (or to ``time_limit_s``). ``give_up``: called with every lower bound the solver
        proves on ``estimated_cost_s`` (the objective ÷ :attr:`amortized_over`; ``"shard"`` plans, whose estimate is
        the objective); once it returns true, :class:`.sharding.ilp.AboveCutoff` is raised with that bound (in the
        same units) and the bound is kept in :attr:`lower_bound_s`."""
        if self.final is not None:
            return self.final
        allowed = _restrictions(self.kind, self.solver_graph, self.batch_axes, self.sequence_parallel)
        per_objective = None if give_up is None else (lambda bound_s: give_up(bound_s / self.amortized_over))
        try:
            solution = solve(
                self.solver_graph,
                memory_budget=memory_budget,
                time_limit_s=time_limit_s,
                allowed=allowed,
                give_up=per_objective,
                hint=self.probed_choice,
            )
        except AboveCutoff as stopped:
            self.probed_bound_s = max(self.probed_bound_s, stopped.bound_s)
            raise AboveCutoff(stopped.bound_s / self.amortized_over) from None
        return self._result(solution)

    def _result(self, solution: Solution) -> IntraOpResult:
        stage, communication_s, extra = _stage_from_solution(
            self.kind, self.graph, self.solver_graph, solution, self.mesh, self.trainable, self.optimizer_state_copies
        )
        if self.amortized_over > 1:
            share = 1.0 / self.amortized_over
            stage.estimated_cost_s *= share
            stage.estimated_compute_s *= share
            stage.estimated_communication_s *= share
            communication_s *= share
        stage.crosses_hosts = list(
            axes_crossing_hosts(
                self.submesh or submesh_of(self.mesh.num_devices, self.cluster.devices_per_host), self.mesh.shape
            )
        )
        return IntraOpResult(
            stage,
            self.solver_graph,
            solution,
            communication_s,
            self.build_s,
            rebuild=self.rebuild,
            extra_collective_bytes=extra,
        )


def prepare_stage(graph: Graph, problem: StageProblem, mesh_shape: tuple[int, int]) -> PreparedStage:
    """The solver graph of ``problem`` for stage ``graph`` on a logical mesh of ``mesh_shape``, to bound or solve."""
    kind, cluster, submesh, trainable = problem.kind, problem.cluster, problem.submesh, set(problem.trainable)
    mesh = logical_mesh(mesh_shape, cluster, submesh)
    start = time.perf_counter()
    live_axes = tuple(a for a in (0, 1) if mesh_shape[a] > 1)
    if kind in ("data_parallel", "zero2", "zero3"):
        batch_axes: tuple[int, ...] | None = live_axes
    elif kind == "megatron":
        batch_axes = (0,) if mesh_shape[0] > 1 else ()
    else:
        batch_axes = None

    def rebuild(on: LogicalMesh) -> SolverGraph:
        return build_solver_graph(
            graph,
            on,
            trainable=trainable,
            optimizer_state_copies=problem.optimizer_state_copies,
            batch_dim_axes=batch_axes,
            num_micro_batches=problem.num_micro_batches,
            # ZeRO-3 keeps only its gradient shard: it reduce-scatters every micro-batch
            accumulated_weight_grads=kind != "zero3",
            remat=problem.remat,
            in_flight=problem.in_flight,
            experts=problem.experts,
            context=problem.context,
        )

    solver_graph = rebuild(mesh)
    cheapest = float(sum(min(root.cost) for root in solver_graph.roots if len(root.cost)))
    return PreparedStage(
        graph,
        kind,
        mesh,
        cluster,
        submesh,
        trainable,
        problem.optimizer_state_copies,
        solver_graph,
        batch_axes,
        time.perf_counter() - start,
        rebuild,
        cheapest,
        problem.sequence_parallel,
        amortized_over=problem.num_micro_batches if problem.per_micro_batch else 1,
    )


def plan_best_mesh(
    graph: Graph,
    problem: StageProblem,
    mesh_shapes: list[tuple[int, int]],
    memory_budget: float | None = None,
    time_limit_s: float = 30.0,
) -> IntraOpResult:
    """Solve on each candidate mesh shape and keep the cheapest plan."""
    best: IntraOpResult | None = None
    errors = []
    trials: list[dict] = []
    for shape in mesh_shapes:
        try:
            result = plan_stage(graph, problem, shape, memory_budget, time_limit_s)
        except ValueError as error:  # e.g. a batch that does not divide this mesh
            errors.append(f"{shape}: {error}")
            trials.append({"logical_mesh_shape": list(shape), "error": str(error)})
            continue
        log.info(
            "mesh %s: estimated %.3g s (communication %.3g s)",
            shape,
            result.stage.estimated_cost_s,
            result.communication_s,
        )
        trials.append(
            {
                "logical_mesh_shape": list(shape),
                "estimated_step_s": result.stage.estimated_cost_s,
                "estimated_memory_bytes": result.stage.estimated_memory_bytes,
                "chosen": False,
            }
        )
        if best is None or result.stage.estimated_cost_s < best.stage.estimated_cost_s:
            best = result
    if best is None:
        raise ValueError("no logical mesh admits a plan:\n  " + "\n  ".join(errors))
    for trial in trials:
        trial["chosen"] = trial["logical_mesh_shape"] == list(best.stage.logical_mesh_shape)
    best.mesh_trials = trials
    return best


# --- restrictions (hand plans) ---------------------------------------------------------------------------


def _restrictions(
    kind: PlanKind, graph: SolverGraph, batch_axes: tuple[int, ...] | None, sequence_parallel: bool = False
) -> dict[int, set[int]]:
    allowed: dict[int, set[int]] = {}
    if kind in ("data_parallel", "zero2", "zero3"):
        for v, root in enumerate(graph.roots):
            if root.kind == "param":
                allowed[v] = {k for k, s in enumerate(root.strategies) if not any(s.out_spec)}
            elif root.kind == "anchor":
                # ops split their batch (leading output) dim over every batch axis; where that dim does not
                # divide (or is not a batch dim, e.g. size 1), they split it partly or not at all
                only_batch = {
                    k for k, s in enumerate(root.strategies) if not any(s.out_spec[1:]) and _splits_only_output(s)
                }
                whole_batch = {k for k in only_batch if root.strategies[k].out_spec[0] == (batch_axes or None)}
                if whole_batch or only_batch:
                    allowed[v] = whole_batch or only_batch
    elif kind == "megatron":
        allowed.update(_megatron_restrictions(graph, sequence_parallel))
    return allowed


def _splits_only_output(strategy: Strategy) -> bool:
    """Every mesh axis the strategy uses splits its output (no contracted-dim splits; a matmul whose contracted
    split is reduce-scattered into its output rows, ``…>m@A``, splits a contracted dim too), and it runs as the op
    does or as a row exchange (a gather by a whole index keeping its rows split: data parallelism for a batch that
    is permuted, as a mixture-of-experts layer's tokens are)."""
    out_axes = {a for entry in strategy.out_spec if entry for a in entry}
    used = {a for spec in strategy.in_specs if spec for entry in spec if entry for a in entry}
    return used <= out_axes and (not strategy.lowering or is_exchange(strategy))


def _megatron_restrictions(graph: SolverGraph, sequence_parallel: bool = False) -> dict[int, set[int]]:
    allowed: dict[int, set[int]] = {}
    position_in_block: dict[str, int] = {}
    for v, root in enumerate(graph.roots):
        if root.kind != "anchor" or not root.label.startswith(("aten.mm.", "aten.addmm.")):
            continue
        operands = graph.anchor_operands[root.name]
        weight_roots = [graph.values[r].root for r in operands if r in graph.values]
        if not any(graph.roots[w].kind == "param" for w in weight_roots):
            continue
        path = root.label.split(" ", 1)[1] if " " in root.label else ""
        block = re.match(r"^(.*?\.\d+)(\.|$)", path)
        if block:
            index = position_in_block.get(block.group(1), 0)
            position_in_block[block.group(1)] = index + 1
            split_label = "n" if index % 2 == 0 else "k"
        else:
            split_label = "n"
        names = {f"{split_label}@1", f"m@0,{split_label}@1", "replicated", "m@0"}
        if sequence_parallel and split_label == "k":  # the output's tokens scattered over axis 1
            names = {"k@1>m@1", "m@0,k@1>m@01", "replicated", "m@0"}
        wanted = {k for k, s in enumerate(root.strategies) if s.name in names and f"{split_label}@1" in s.name}
        if not wanted:  # mesh axis 1 has size 1 or the dim does not divide: plain data parallel
            wanted = {k for k, s in enumerate(root.strategies) if s.name in names}
        allowed[v] = wanted
    return allowed


# --- solution → stage plan ----------------------------------------------------------------------------


def _stage_from_solution(
    kind: PlanKind,
    graph: Graph,
    solver_graph: SolverGraph,
    solution: Solution,
    mesh: LogicalMesh,
    trainable: set[str],
    state_copies: float,
) -> tuple[StagePlan, float, dict[str, float]]:
    """The stage plan of ``solution``, its communication seconds, and the per-device bytes of collectives ZeRO
    adds after the solve (by kind)."""
    choice = solution.choice
    params: dict[str, Spec] = {}
    inputs: dict[str, Spec] = {}
    activations: dict[str, Spec] = {}
    operands: dict[str, list[Spec | None]] = {}
    strategies: dict[str, str] = {}
    op_options: dict[str, dict[str, str]] = {}
    compute_s = 0.0
    metas = {i.name: i for i in graph.inputs}
    for root, k in zip(solver_graph.roots, choice):
        strategy = root.strategies[k]
        compute_s += strategy.compute_s * (4.0 / 3.0 if root.name in solver_graph.recomputed else 1.0)
        if root.kind == "param":
            params[root.label] = strategy.out_spec
        elif root.kind == "input":
            inputs[metas[root.name].target] = strategy.out_spec
        elif root.kind == "activation":
            activations[root.name] = strategy.out_spec
        elif root.kind == "anchor":
            activations[root.name] = strategy.out_spec
            operands[root.name] = list(strategy.in_specs)
            strategies[root.name] = f"{root.label}: {strategy.name}"
            if strategy.lowering:
                op_options[root.name] = dict(strategy.lowering)
    objective = solution.objective_s
    communication = objective - compute_s
    grads: dict[str, Spec] = {}
    optimizer_state: dict[str, Spec] = {}
    params_at_use: dict[str, Spec] = {}
    breakdown = memory_breakdown(solver_graph, choice, trainable, state_copies)
    extra_bytes: dict[str, float] = {}
    if kind in ("zero2", "zero3"):
        param_metas = {i.target: i.meta for i in graph.inputs if i.kind == "param"}
        live_axes = tuple(a for a in (0, 1) if mesh.shape[a] > 1)
        whole_gradient = 0.0
        for name in sorted(trainable):
            meta = param_metas.get(name)
            sharded = _zero_spec(meta.shape, live_axes, mesh) if meta is not None else None
            if meta is None or sharded is None:
                continue
            grads[name] = optimizer_state[name] = sharded
            saved = meta.nbytes * (1 - 1 / mesh.num_devices)
            breakdown["optimizer_state"] -= saved * state_copies
            breakdown["gradients"] -= saved
            if kind == "zero3":
                # stored sharded, but gathered whole for the forward and backward (the gathered copy is live at the
                # step's peak); each gradient is whole from its producer to its reduce-scatter, one at a time at the
                # peak as XLA's memory analysis of the compiled step counts them (benchmarks/memory_model.py: with
                # every whole gradient counted the estimate was 27 % over the compiled GPT-2 step)
                whole_gradient = max(whole_gradient, saved)
                breakdown["parameters"] -= saved
                breakdown["gathered_parameters"] = breakdown.get("gathered_parameters", 0.0) + meta.nbytes
                params_at_use[name] = params[name]
                params[name] = sharded
                # gathered inside every micro-batch's forward (and its transpose in the backward)
                gather = solver_graph.num_micro_batches * mesh.all_gather(meta.nbytes, live_axes)
                communication += gather
                objective += gather
                groups = math.prod(mesh.shape[a] for a in live_axes)
                extra_bytes["all_gather"] = (
                    extra_bytes.get("all_gather", 0.0)
                    + solver_graph.num_micro_batches * meta.nbytes * (groups - 1) / groups
                )
    if kind == "zero3":
        breakdown["gradients"] += whole_gradient
    breakdown = {part: max(nbytes, 0.0) for part, nbytes in breakdown.items()}
    stage = StagePlan(
        layers=[0],
        submesh_shape=(1, mesh.num_devices),
        logical_mesh_shape=mesh.shape,
        params={n: to_json(s) for n, s in params.items()},
        estimated_cost_s=objective,
        estimated_compute_s=compute_s,
        estimated_communication_s=communication,
        estimated_memory_bytes=int(sum(breakdown.values())),
        memory_breakdown=breakdown,
        grads={n: to_json(s) for n, s in grads.items()},
        optimizer_state={n: to_json(s) for n, s in optimizer_state.items()},
        params_at_use={n: to_json(s) for n, s in params_at_use.items()},
        inputs={n: to_json(s) for n, s in inputs.items()},
        activations={n: to_json(s) for n, s in activations.items()},
        operands={n: [to_json(s) if s is not None else None for s in specs] for n, specs in operands.items()},
        strategies=strategies,
        op_options=op_options,
    )
    return stage, communication, extra_bytes


def memory_breakdown(
    solver_graph: SolverGraph, choice: list[int], trainable: set[str], state_copies: float
) -> dict[str, float]:
    """Per-device bytes at the step's peak under ``choice``, by what they hold: ``parameters``, ``gradients``,
    ``optimizer_state`` (a trainable parameter root holds ``2 + state_copies`` copies of its local shard),
    ``activations`` (batch inputs, activations from the previous stage, every op output kept for the backward
    pass), ``buffers`` (buffers and constants), ``gathered_parameters`` (parameters gathered into a larger
    layout for their use, live until the backward) and ``transients`` (the largest bytes one op holds while it
    runs, :func:`.sharding.ilp.transient_peak`). Sums to the ILP's memory of ``choice``."""
    parts = dict.fromkeys(("parameters", "gradients", "optimizer_state", "activations", "buffers"), 0.0)
    gathered = gathered_memory(solver_graph, choice)
    if gathered:
        parts["gathered_parameters"] = gathered
    transients = transient_peak(solver_graph, choice)
    if transients:
        parts["transients"] = transients
    for root, k in zip(solver_graph.roots, choice):
        own = float(root.strategies[k].memory_bytes)
        followers = float(root.memory[k]) - own  # ops that follow the root keep their outputs
        parts["activations"] += followers
        if root.kind == "param":
            copies = 2.0 + state_copies if root.label in trainable else 1.0
            local = own / copies
            parts["parameters"] += local
            if root.label in trainable:
                parts["gradients"] += local
                parts["optimizer_state"] += local * state_copies
        elif root.kind in ("input", "activation", "anchor"):
            parts["activations"] += own
        else:
            parts["buffers"] += own
    return parts


def _zero_spec(shape: tuple[int, ...], axes: tuple[int, ...], mesh: LogicalMesh) -> Spec | None:
    """Shard the largest dim that divides evenly over all ``axes`` (ZeRO partitioning), else ``None``."""
    if not axes:
        return None
    pieces = math.prod(mesh.shape[a] for a in axes)
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        spec = make_spec(len(shape), {dim: axes})
        if shape[dim] % pieces == 0 and is_valid(spec, shape, mesh.shape):
            return spec
    return None


__all__ = [
    "IntraOpResult",
    "PLAN_KINDS",
    "PreparedStage",
    "evaluate",
    "logical_mesh",
    "mesh_shapes_for",
    "plan_best_mesh",
    "plan_stage",
    "prepare_stage",
]
