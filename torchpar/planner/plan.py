"""The Plan: what runs where. Plain data with a JSON round trip (its fields: ``docs/api.md``, ``Plan``).

A spec is a list with one entry per tensor dim: ``None`` if replicated along it, else the list of
logical mesh axes (0 and/or 1) the dim is split over.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from torchpar import plan_writers
from torchpar.hardware import ClusterSpec
from torchpar.ir.layout import JsonSpec, describe
from torchpar.ir.op_families import GROUPED_MATMULS
from torchpar.methods import method_title
from torchpar.planner.plan_schema import (
    FORMER_METHOD_NAMES,
    PlanFormatError,
    validate_plan_dict,
)
from torchpar.units import format_bytes, format_flops, format_seconds

Spec = JsonSpec


@dataclass(kw_only=True)
class StagePlan:
    """One pipeline stage: its layers, submesh, logical mesh and the layout of every tensor it pins.

    ``params`` are keyed by ``named_parameters()`` names; ``grads`` and ``optimizer_state`` default to the
    parameter's spec (they differ under ZeRO); ``params_at_use`` is the layout a parameter is gathered to
    where the model reads it (ZeRO-3). ``inputs`` are keyed by the batch leaf's flattened position;
    ``activations`` and ``operands`` by IR node name (the op's output, and each tensor operand it reads).
    """

    layers: list[int]
    submesh_shape: tuple[int, int]
    logical_mesh_shape: tuple[int, int]
    params: dict[str, Spec]
    estimated_cost_s: float
    estimated_compute_s: float = 0.0
    estimated_communication_s: float = 0.0
    estimated_memory_bytes: int = 0
    grads: dict[str, Spec] = field(default_factory=dict)
    optimizer_state: dict[str, Spec] = field(default_factory=dict)
    params_at_use: dict[str, Spec] = field(default_factory=dict)
    inputs: dict[str, Spec] = field(default_factory=dict)
    activations: dict[str, Spec] = field(default_factory=dict)
    operands: dict[str, list[Spec | None]] = field(default_factory=dict)
    strategies: dict[str, str] = field(default_factory=dict)
    op_options: dict[str, dict[str, str]] = field(default_factory=dict)
    """Keyword arguments an op's lowering takes to run its chosen strategy, by node name (an attention with its
    sequence split: ``{"context": "ring"}`` or ``"allgather"``)."""
    data_replicas: int = 1
    """Copies of this stage's ``d0 × d1`` plan along an outer data axis (a 3-D mesh ``(data, d0, d1)``, the data
    axis pinned to the batch): each replica holds the parameters as the plan lays them out on its own devices and
    trains on ``1/data_replicas`` of every batch's rows (replica ``r`` the ``r``-th block); the replicas' gradients
    are combined once per step. The layouts in this stage never name the data axis. 1 = a 2-D mesh."""
    device_ids: list[int] = field(default_factory=list)
    """Cluster device indices of the submesh (host ``h`` owns ``[h·D, (h+1)·D)`` for ``D`` devices per host),
    in the mesh's row-major order (``(data, d0, d1)`` with data replicas); empty means the first
    ``data_replicas·d0·d1`` devices."""
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    """Per-device bytes of :attr:`estimated_memory_bytes` by part: ``parameters``, ``gradients``,
    ``optimizer_state``, ``activations``, ``buffers``."""
    communication_bytes: dict[str, float] = field(default_factory=dict)
    """Per-device bytes sent per step (pipelines: per micro-batch) by collective kind (``all_reduce``,
    ``all_gather``, ``reduce_scatter``, ``all_to_all``); filled where the plan is explained (:func:`torchpar.plan`)."""
    crosses_hosts: list[bool] = field(default_factory=list)
    """Per logical mesh axis: whether its collectives reach more than one host (priced with the link between
    hosts, :mod:`torchpar.planner.mesh_links`)."""
    compiled_memory_bytes: int | None = None
    """Per-device bytes of the compiled stage by XLA's memory analysis (arguments + outputs − aliased +
    temporaries; :func:`torchpar.runtime.resources.executable_peak_bytes`), beside :attr:`estimated_memory_bytes`;
    recorded by ``engine.measured()`` / ``engine.save_report``, ``None`` in a plan that was not compiled."""
    measured_cost_s: float | None = None
    """Seconds of the compiled stage's forward + backward (per micro-batch in a pipeline), timed on its devices by
    measured profiling (``profile=True``, :mod:`torchpar.planner.profiling`), beside :attr:`estimated_cost_s`;
    ``None`` when the plan was not profiled."""

    def devices(self) -> list[int]:
        """:attr:`device_ids`, or the first ``data_replicas·d0·d1`` device indices when none are stored."""
        return list(self.device_ids) or list(range(self.num_devices))

    @property
    def num_devices(self) -> int:
        """``data_replicas·d0·d1``: the devices this stage runs on."""
        return self.data_replicas * self.logical_mesh_shape[0] * self.logical_mesh_shape[1]

    def mesh_text(self) -> str:
        """The mesh as the summary shows it: ``(2, 4)``, or ``2 data × (2, 2)`` with data replicas."""
        shape = str(tuple(self.logical_mesh_shape))
        return f"{self.data_replicas} data × {shape}" if self.data_replicas > 1 else shape


@dataclass(kw_only=True)
class Plan:
    """A parallel execution plan; ``docs/api.md`` (``Plan``) lists the fields of its serialized form."""

    method: str
    """The method's one name (:data:`torchpar.methods.METHOD_NAMES`): ``single_device``, ``data_parallel``,
    ``zero2``, ``zero3``, ``megatron``, ``shard`` or ``pipeshard``."""
    stages: list[StagePlan]
    num_micro_batches: int = 1
    schedule: str = "none"
    estimated_step_s: float = 0.0
    solver: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    layers: list[dict[str, float]] = field(default_factory=list)
    """Per pipeline layer: forward ``flops`` and entering ``activation_bytes`` (pipeline plans)."""
    cluster: dict[str, Any] = field(default_factory=dict)
    """The cluster the plan was made for (:meth:`ClusterSpec.cost_constants`, JSON values): ``num_hosts``,
    ``devices_per_host`` and the cost constants it was priced with."""
    layer_of_node: dict[str, int] = field(default_factory=dict)
    """Pipeline plans: the layer of every node of the graph captured on one micro-batch (IR node names), so
    the plan alone says how to cut the graph into its stages (with each stage's ``layers``)."""
    numerics: dict[str, str] = field(default_factory=dict)
    """What the step was compiled to compute with (filled by the engine): ``matmul_precision`` and
    ``conv_precision`` (``"highest"``/``"high"``/``"medium"``), ``effective`` (what the platform computes),
    ``mixed_precision`` (``"bf16"``/``"fp16"``/``"none"``), ``loss_scaling`` (``"dynamic"``/``"none"``)."""
    remat: str = "none"
    """Activation checkpointing of each layer (:mod:`torchpar.planner.remat`): ``"none"``, ``"layers"`` or
    ``"selective"``."""

    @property
    def is_pipeline(self) -> bool:
        return self.method == "pipeshard"  # PipeshardParallel.name

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for stage in data["stages"]:
            stage["submesh_shape"] = list(stage["submesh_shape"])
            stage["logical_mesh_shape"] = list(stage["logical_mesh_shape"])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan ``data`` (:meth:`to_dict`'s form) describes, former method names renamed. Raises
        :class:`~torchpar.planner.plan_schema.PlanFormatError` (a ``ValueError``) naming the first bad field."""
        validate_plan_dict(data)
        data = {**data, "method": FORMER_METHOD_NAMES.get(data["method"], data["method"])}
        stages = [
            StagePlan(
                **{
                    **s,
                    "submesh_shape": tuple(s["submesh_shape"]),
                    "logical_mesh_shape": tuple(s["logical_mesh_shape"]),
                }
            )
            for s in data["stages"]
        ]
        return cls(**{**data, "stages": stages})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan in ``text`` (a plan file's contents), read with ``json`` only. Raises
        :class:`~torchpar.planner.plan_schema.PlanFormatError` if it is not JSON (with the line and column) or
        not a valid plan (naming the bad field)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanFormatError(
                f"plan is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
            ) from error
        except (ValueError, RecursionError) as error:  # e.g. an int of over 4300 digits; arrays nested too deeply
            raise PlanFormatError(f"plan is not valid JSON: {error or type(error).__name__}") from error
        return cls.from_dict(data)

    def headline(self) -> str:
        """The plan in one line: method, stages and their meshes, micro-batches, estimated step."""
        meshes = ", ".join(stage.mesh_text() for stage in self.stages)
        return (
            f"{method_title(self.method)}: {len(self.stages)} stage(s) on {meshes}, {self.num_micro_batches} "
            f"micro-batch(es), estimated step {format_seconds(self.estimated_step_s)}"
        )

    def summary(self) -> str:
        """The plan as text: the estimate and what priced it, each stage with its costs, memory by part, the
        collectives it sends, every parameter's layout; the alternatives weighed; solver and compile phases."""
        estimate = self.solver.get("estimate", {})
        how = f" [{estimate['model']}; {estimate['step_formula']}]" if estimate else ""
        lines = [
            f"Plan: {method_title(self.method)}, {len(self.stages)} stage(s), {self.num_micro_batches} "
            f"micro-batch(es), schedule {self.schedule}, estimated step {format_seconds(self.estimated_step_s)}{how}"
        ]
        if any(stage.params or stage.inputs for stage in self.stages):
            lines.append(f"  {LAYOUT_LEGEND}")
        for index, stage in enumerate(self.stages):
            crossing = [str(a) for a, cross in enumerate(stage.crosses_hosts) if cross]
            hosts = f" (axis {', '.join(crossing)} crosses hosts)" if crossing else ""
            lines.append(
                f"  stage {index}: layers {stage.layers}, submesh {tuple(stage.submesh_shape)}, logical mesh "
                f"{stage.mesh_text()}{hosts}, est. {format_seconds(stage.estimated_cost_s)} "
                f"(compute {format_seconds(stage.estimated_compute_s)}, communication "
                f"{format_seconds(stage.estimated_communication_s)}), {len(stage.params)} params"
                + (
                    f"; measured {format_seconds(stage.measured_cost_s)}"
                    f" (estimate {stage.estimated_cost_s / stage.measured_cost_s - 1:+.0%})"
                    if stage.measured_cost_s
                    else ""
                )
            )
            parts = ", ".join(
                f"{part.replace('_', ' ')} {format_bytes(n)}" for part, n in stage.memory_breakdown.items() if n
            )
            compiled = ""
            if stage.compiled_memory_bytes:
                error = stage.estimated_memory_bytes / stage.compiled_memory_bytes - 1
                compiled = f"; compiled {format_bytes(stage.compiled_memory_bytes)} (estimate {error:+.0%})"
            budget = (self.cluster or {}).get("device_memory_bytes")
            headroom = (
                (
                    f"; headroom {format_bytes(budget - stage.estimated_memory_bytes)} of "
                    f"{format_bytes(budget)} ({1 - stage.estimated_memory_bytes / budget:.1%})"
                )
                if budget
                else ""
            )
            lines.append(
                f"    est. memory {format_bytes(stage.estimated_memory_bytes)} per device"
                + (f" ({parts})" if parts else "")
                + headroom
                + compiled
            )
            if stage.communication_bytes:
                sent = (
                    ", ".join(
                        f"{kind.replace('_', '-')} {format_bytes(n)}"
                        for kind, n in stage.communication_bytes.items()
                        if n
                    )
                    or "none"
                )
                lines.append(f"    collectives sent per device: {sent}")
            if stage.data_replicas > 1:
                per_replica = stage.num_devices // stage.data_replicas
                lines.append(
                    f"    data axis: {stage.data_replicas} replicas of this plan, replica r on devices "
                    f"[r·{per_replica}, (r+1)·{per_replica}) training on the r-th block of every batch's "
                    "rows (the layouts below are one replica's); gradients all-reduced over the replicas "
                    "once per step"
                )
            width = max((len(n) for n in stage.params), default=0)
            for name, spec in stage.params.items():
                extra = ""
                if stage.optimizer_state.get(name, spec) != spec:
                    extra += f"  optimizer state {stage.optimizer_state[name]}"
                if stage.grads.get(name, spec) != spec:
                    extra += f"  grad {stage.grads[name]}"
                lines.append(f"    {name:<{width}}  {describe(spec)}{extra}")
            for leaf, spec in stage.inputs.items():
                lines.append(f"    batch leaf {leaf}: {describe(spec)}")
            lines.extend(_expert_lines(stage))
            lines.extend(_sequence_lines(stage))
        tight = [
            index
            for index, stage in enumerate(self.stages)
            if self.cluster.get("device_memory_bytes")
            and stage.estimated_memory_bytes >= 0.99 * self.cluster["device_memory_bytes"]
        ]
        if tight:
            lines.append(
                f"  memory: stage(s) {tight} within 1% of the device memory: the ILP bought speed with memory "
                "up to the limit, so XLA's workspace beyond the estimate may not fit; plan for less "
                "(torchpar.init(..., device_memory_bytes=...)) to keep headroom"
            )
        if self.numerics:
            lines.append(
                f"  numerics: {self.numerics.get('effective', '')}; mixed precision "
                f"{self.numerics.get('mixed_precision', 'none')}, loss scaling "
                f"{self.numerics.get('loss_scaling', 'none')}"
            )
        counts = self.solver.get("micro_batches")
        if counts:
            lines.append(
                f"  micro-batches: auto → {self.num_micro_batches} of {counts['rows'] // counts['chosen']} "
                f"row(s) (counts tried, most micro-batches first; the scan stops after two that do not win)"
            )
            for row in counts.get("tried", []):
                verdict = (
                    f"est. step {format_seconds(row['estimated_step_s'])}"
                    if row["outcome"] == "planned"
                    else f"step at least {format_seconds(row['step_at_least_s'])}: not planned to the end"
                    if row["outcome"] == "pruned"
                    else f"does not fit: {row.get('error', '')}"
                )
                lines.append(f"    {row['count']:>6}  {verdict}")
        choice = self.solver.get("remat")
        if choice:
            lines.append(f"  remat: auto → {self.remat}: {choice.get('reason', '')}")
            for row in choice.get("candidates", []):
                priced = (
                    f"est. step {format_seconds(row['estimated_step_s'])}, "
                    f"{format_bytes(row['estimated_memory_bytes'])} per device"
                    if "estimated_step_s" in row
                    else ""
                )
                verdict = (
                    "fits"
                    if row.get("fits")
                    else f"not planned to the end: {row.get('error', '')}"
                    if row.get("pruned")
                    else f"does not fit: {row.get('error', '')}"
                )
                lines.append(f"    {row['remat']:<10} {priced}{'; ' if priced else ''}{verdict}")
        if self.remat != "none":
            lines.append(f"  remat: {self.remat} ({_REMAT_MEANING[self.remat]})")
        constants = self.solver.get("cost_constants")
        if constants:
            lines.append(f"  cost constants: {_constants_line(constants)}")
        lines.extend(_alternatives(self.solver))
        lines.extend(_profile_lines(self.solver.get("profile")))
        stats = {k: v for k, v in self.solver.items() if k not in _EXPLAINED_SOLVER_KEYS}
        if stats:
            lines.append(
                "  solver: " + ", ".join(f"{k.replace('_', ' ')} {_solver_value(v)}" for k, v in stats.items())
            )
        if self.timings:
            lines.append("  compile phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()))
        return "\n".join(lines)

    def save_html(self, path: str, timeline: object = None, **options: object) -> object:
        """Write a self-contained HTML report and return its path; see :func:`torchpar.report.html.render_html`
        for ``timeline`` (a measured step) and the ``options`` (``cluster``, ``param_shapes``, ``layer_stats``,
        ``title``, ``measured``: what a run measured, shown beside the estimates — ``engine.save_report`` fills
        it)."""
        if "layer_stats" not in options and self.layers:
            options["layer_stats"] = self.layers
        if "cluster" not in options and self.cluster:
            options["cluster"] = ClusterSpec(**self.cluster)
        return plan_writers.writer("html")(self, path, timeline=timeline, **options)

    def save_png(self, path: str, **options: object) -> None:
        """Write a PNG of the device grid and the pipeline timeline (:func:`torchpar.report.png.save_png`)."""
        plan_writers.writer("png")(self, path, **options)


_REMAT_MEANING = {
    "layers": "each layer's forward recomputed in its backward; its input kept",
    "selective": "each layer's input and linear-layer outputs kept; the rest recomputed",
}
_EXPLAINED_SOLVER_KEYS = (
    "estimate",
    "stage_partition",
    "runners_up",
    "mesh_shapes",
    "expert_layouts",
    "method_comparison",
    "remat",
    "profile",
)
"""``Plan.solver`` entries :meth:`Plan.summary` shows in their own lines."""


def _alternatives(solver: dict[str, Any]) -> list[str]:
    """The alternatives the planner weighed, one line each, priced by the plan's own model unless labelled."""
    lines = []
    for row in solver.get("method_comparison", []):
        shape = tuple(row.get("logical_mesh_shape", ()))
        lines.append(
            f"  compared: {method_title(row['method'])} on {shape}: "
            + (
                f"error: {row['error']}"
                if "error" in row
                else f"est. step {format_seconds(row['estimated_step_s'])}, memory "
                f"{format_bytes(row['estimated_memory_bytes'])}"
            )
        )
    for row in solver.get("mesh_shapes", []):
        shape = tuple(row["logical_mesh_shape"])
        lines.append(
            f"  mesh {shape}: "
            + (
                f"not possible: {row['error'].splitlines()[0]}"
                if "error" in row
                else f"est. step {format_seconds(row['estimated_step_s'])}" + (" (chosen)" if row.get("chosen") else "")
            )
        )
    for row in solver.get("expert_layouts", []):
        what = f"{row['experts']} ({row.get('meaning', EXPERT_FAMILIES.get(row['experts'], ''))})"
        lines.append(
            f"  expert layout {what}: "
            + (
                f"not possible: {row['error'].splitlines()[0]}"
                if "error" in row
                else f"est. step {format_seconds(row['estimated_step_s'])}, memory "
                f"{format_bytes(row['estimated_memory_bytes'])}" + (" (chosen)" if row.get("chosen") else "")
            )
        )
    for row in solver.get("runners_up", []):
        stages = " | ".join(
            f"layers {st['layers']} on {tuple(st['submesh_shape'])} mesh {tuple(st['logical_mesh_shape'])}"
            for st in row["stages"]
        )
        screening = (
            f"; stage DP screening {format_seconds(row['screening_step_s'])}" if "screening_step_s" in row else ""
        )
        if "estimated_step_s" in row:
            lines.append(f"  runner-up: est. step {format_seconds(row['estimated_step_s'])}{screening}: {stages}")
        elif "step_at_least_s" in row:  # its lower bound showed it could not win: not solved to the end
            lines.append(
                f"  runner-up: est. step ≥ {format_seconds(row['step_at_least_s'])} (bound, not solved)"
                f"{screening}: {stages}"
            )
        else:  # the ILP found no sharding of one of its stages
            lines.append(f"  runner-up: not possible{screening}: {stages}: {row.get('error', '').splitlines()[0]}")
    return lines


def _profile_lines(profile: dict[str, Any] | None) -> list[str]:
    """The summary's lines on measured profiling (``plan.solver["profile"]``, :mod:`.profiling`)."""
    if not profile:
        return []
    lines = [
        f"  profiled: measured step {format_seconds(profile['measured_step_s'])} (estimate "
        f"{format_seconds(profile['estimated_step_s'])}); {profile['timed_stages']} stage(s) timed, "
        f"{profile['cached_stages']} from the profile cache"
        + ("; the measurement changed the choice" if profile.get("changed_choice") else "")
    ]
    if len(profile.get("candidates", [])) > 1:
        for row in profile["candidates"]:
            mark = "→" if row["candidate"] == profile["chosen"] else " "
            lines.append(
                f"   {mark} candidate {row['candidate']}: measured {format_seconds(row['measured_step_s'])}, "
                f"estimate {format_seconds(row['estimated_step_s'])}"
            )
    for link in profile.get("links", []):
        lines.append(
            f"    link axis {link['axis']} ({link['devices']} devices): α {link['alpha'] * 1e6:.1f} µs, "
            f"β⁻¹ {1 / link['beta'] / 1e9 if link['beta'] else float('inf'):.2f} GB/s (fitted to "
            f"{len(link['points'])} timed all-reduces)"
        )
    return lines


LAYOUT_LEGEND = (
    "layouts, one word per tensor dim: R = whole (replicated), S0 / S1 / S01 = split over logical mesh "
    "axis 0 / 1 / both (`S1 R`: rows split over axis 1, columns whole)"
)
"""The legend ``summary()`` prints above the layouts (:func:`torchpar.ir.layout.describe` is their one text form)."""


def expert_layouts(stage: StagePlan) -> list[tuple[str, str, str]]:
    """``(module, strategy, meaning)`` for each grouped matmul (mixture of experts) of the stage: split over its
    experts (expert parallelism: mesh axis ``a``'s ``i``-th device holds the ``i``-th block of experts, tokens
    exchanged by all-to-all), over its rows, its hidden dims, or not at all."""
    layouts = []
    for label in stage.strategies.values():
        op, _, strategy = str(label).rpartition(": ")
        target, _, module = op.partition(" ")
        if target not in GROUPED_MATMULS:
            continue
        if strategy.startswith("experts@"):
            parts = dict(part.split("@") for part in strategy.split(","))
            meaning = (
                f"experts split over mesh axis {' and '.join(parts['experts'])} (device i of the axis holds "
                f"the i-th block of experts), rows over axis {' and '.join(parts['s'])}"
                + (f", columns over axis {parts['n']}" if "n" in parts else "")
            )
        else:
            meaning = f"experts on every device ({strategy})"
        layouts.append((module or target, strategy, meaning))
    return layouts


EXPERT_FAMILIES = {
    "split": "each device holds a block of experts, tokens exchanged by all-to-all",
    "tensor": "every expert's hidden dims split",
    "replicated": "every expert whole on every device",
    "rows": "every expert whole, token rows split",
}
"""The families of a grouped matmul's layouts (``ShardParallel.experts`` forces one of the first three)."""


def expert_family(strategy: str) -> str:
    """The :data:`EXPERT_FAMILIES` key of a grouped matmul's strategy name (``experts@1,s@1`` → ``"split"``)."""
    if strategy.startswith("experts@"):
        return "split"
    if strategy == "replicated":
        return "replicated"
    if all(part.split("@")[0] in ("k", "n") for part in strategy.split(",")):
        return "tensor"
    return "rows"


def _expert_lines(stage: StagePlan) -> list[str]:
    """The summary's lines on the stage's grouped matmuls (:func:`expert_layouts`) and row exchanges, with its
    all-to-all bytes."""
    by_meaning: dict[str, list[str]] = {}
    for module, _, meaning in expert_layouts(stage):
        by_meaning.setdefault(meaning, []).append(module)
    lines = [
        f"    experts: {len(modules)} grouped matmul(s), {meaning}: {', '.join(dict.fromkeys(modules))}"
        for meaning, modules in by_meaning.items()
    ]
    moved = _row_exchanges(stage)
    if moved:
        lines.append(
            f"    routing: {len(moved)} gather(s)/put(s) by a whole index keep their rows split, moving only the "
            f"rows other devices need by all-to-all: {', '.join(dict.fromkeys(moved))}"
        )
    exchanged = stage.communication_bytes.get("all_to_all")
    if exchanged and by_meaning:
        lines.append(
            f"    experts: the stage's all-to-alls send {format_bytes(exchanged)} per device per step (tokens to "
            "their experts and back among them, priced for a balanced router)"
        )
    return lines


def _row_exchanges(stage: StagePlan) -> list[str]:
    """The modules of the stage's ``table[idx]`` / ``index_put`` ops that run as a row exchange (``rows@…,exchange``:
    ``torchpar.planner.sharding.exchange_strategies``)."""
    found = []
    for label in stage.strategies.values():
        op, _, strategy = str(label).rpartition(": ")
        target, _, module = op.partition(" ")
        if strategy.startswith("rows@") and strategy.endswith(",exchange"):
            found.append(module or target)
    return found


ATTENTION_TARGET = "aten.scaled_dot_product_attention.default"


def sequence_layouts(stage: StagePlan) -> list[tuple[str, str, str]]:
    """``(module, strategy, meaning)`` for each op of the stage that splits the tokens of a sequence: an attention
    with its sequence split (context parallelism: ``seq@A,ring`` or ``seq@A,allgather``) and a matmul whose output
    rows are reduce-scattered (Megatron's sequence parallelism: ``…>m@A``)."""
    layouts = []
    for label in stage.strategies.values():
        op, _, strategy = str(label).rpartition(": ")
        target, _, module = op.partition(" ")
        if target == ATTENTION_TARGET and strategy.startswith("seq@"):
            parts = strategy.split(",")
            axes = " and ".join(parts[0].removeprefix("seq@"))
            how = {"ring": "keys/values passed around a ring", "allgather": "keys/values all-gathered"}.get(
                parts[-1], parts[-1]
            )
            others = parts[1:-1]
            meaning = f"context parallelism: sequence split over mesh axis {axes}, {how}" + (
                f" ({', '.join(others)})" if others else ""
            )
        elif ">m@" in strategy:
            meaning = (
                f"sequence parallelism: output tokens reduce-scattered over mesh axis "
                f"{' and '.join(strategy.rpartition('>m@')[2])}"
            )
        else:
            continue
        layouts.append((module or target, strategy, meaning))
    return layouts


def _sequence_lines(stage: StagePlan) -> list[str]:
    """The summary's lines on the ops that split the sequence (:func:`sequence_layouts`), by what they do."""
    by_meaning: dict[str, list[str]] = {}
    for module, _, meaning in sequence_layouts(stage):
        by_meaning.setdefault(meaning, []).append(module)
    return [
        f"    sequence: {len(modules)} op(s), {meaning}: {', '.join(dict.fromkeys(modules))}"
        for meaning, modules in by_meaning.items()
    ]


def _constants_line(record: dict[str, Any]) -> str:
    """Where the plan's cost constants came from (``plan.solver["cost_constants"]``,
    :mod:`torchpar.engine.machine_constants`)."""
    if record.get("source") != "measured":
        return str(record.get("source"))
    cached = ", from the profile cache" if record.get("cached") else ""
    return (
        f"measured on this machine ({record['busy_devices']} busy device(s){cached}): "
        f"{format_flops(record['flops'])}/s per device, {format_seconds(record['op_s'])} per op, "
        f"{format_seconds(record['update_s'] * 1e6)} per million parameters updated → "
        f"{format_flops(record['device_flops'])}/s for this graph's {record['graph_ops']} ops and "
        f"{record['graph_params'] / 1e6:.3g} M trained parameters"
    )


def _solver_value(value: object) -> str:
    """A solver statistic for the summary: floats to 4 significant digits, lists and dicts by their size."""
    if isinstance(value, bool) or not isinstance(value, (float, list, dict)):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"[{len(value)} entries]" if isinstance(value, list) else f"{{{len(value)} keys}}"
