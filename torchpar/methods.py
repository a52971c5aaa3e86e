"""Parallel methods and their options: what ``torchpar.compile(method=...)`` accepts.

``None`` runs on one device. The others describe a plan family; the planner turns them into a
:class:`torchpar.planner.plan.Plan`. Each method has one name (``DataParallel.name == "data_parallel"``),
used alike by ``Plan.method`` in the JSON and by ``python -m torchpar --method``: :data:`METHOD_NAMES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

SINGLE_DEVICE = "single_device"
"""The name of ``method=None``: everything on one device."""


@dataclass(kw_only=True, frozen=True)
class DataParallel:
    """Batch split over all devices, parameters replicated, gradients all-reduced."""

    name: ClassVar[str] = "data_parallel"
    """This method's name in ``Plan.method`` and on the command line."""

    mesh_shape: tuple[int, int] | None = None
    """Logical mesh ``(d0, d1)`` over the first ``d0·d1`` devices; ``None`` = ``(1, all devices)``."""
    num_micro_batches: int = 1
    """Gradient accumulation: the batch is cut into this many micro-batches (row ``i`` goes to micro-batch
    ``i mod num_micro_batches``) run one after another inside the step's executable; their gradients are summed
    on each device and synchronized once per step. The batch size must divide evenly."""

    def __post_init__(self) -> None:
        _check_mesh_shape(self.mesh_shape)
        _check_micro_batches(self.num_micro_batches)


@dataclass(kw_only=True, frozen=True)
class Zero2Parallel:
    """Data parallel with gradients reduce-scattered and optimizer state sharded (ZeRO stage 2)."""

    name: ClassVar[str] = "zero2"
    """This method's name in ``Plan.method`` and on the command line."""

    mesh_shape: tuple[int, int] | None = None
    """Logical mesh ``(d0, d1)`` over the first ``d0·d1`` devices; ``None`` = ``(1, all devices)``."""
    num_micro_batches: int = 1
    """Gradient accumulation: the batch is cut into this many micro-batches (row ``i`` goes to micro-batch
    ``i mod num_micro_batches``) run one after another inside the step's executable; their gradients are summed
    on each device and synchronized once per step. The batch size must divide evenly."""

    def __post_init__(self) -> None:
        _check_mesh_shape(self.mesh_shape)
        _check_micro_batches(self.num_micro_batches)


@dataclass(kw_only=True, frozen=True)
class Zero3Parallel:
    """ZeRO stage 3: parameters sharded too, all-gathered where used."""

    name: ClassVar[str] = "zero3"
    """This method's name in ``Plan.method`` and on the command line."""

    mesh_shape: tuple[int, int] | None = None
    """Logical mesh ``(d0, d1)`` over the first ``d0·d1`` devices; ``None`` = ``(1, all devices)``."""
    num_micro_batches: int = 1
    """Gradient accumulation: the batch is cut into this many micro-batches (row ``i`` goes to micro-batch
    ``i mod num_micro_batches``) run one after another inside the step's executable; their gradients are summed
    on each device and synchronized once per step. The batch size must divide evenly."""

    def __post_init__(self) -> None:
        _check_mesh_shape(self.mesh_shape)
        _check_micro_batches(self.num_micro_batches)


@dataclass(kw_only=True, frozen=True)
class MegatronParallel:
    """Hand plan: Megatron-style tensor parallelism on mesh axis 1 (in each repeated block the linear
    layers alternate column- and row-split), data parallelism on axis 0."""

    name: ClassVar[str] = "megatron"
    """This method's name in ``Plan.method`` and on the command line."""

    mesh_shape: tuple[int, int] | None = None
    """Logical mesh ``(d0, d1)``; ``None`` = ``(1, all devices)`` (pure tensor parallelism)."""
    num_micro_batches: int = 1
    """Gradient accumulation: the batch is cut into this many micro-batches (row ``i`` goes to micro-batch
    ``i mod num_micro_batches``) run one after another inside the step's executable; their gradients are summed
    on each device and synchronized once per step. The batch size must divide evenly."""
    sequence_parallel: bool = False
    """Megatron-LM's sequence parallelism: each row-split linear layer reduce-scatters its output over the
    tokens (instead of all-reducing it), the norms, dropout and residual adds between the tensor-parallel
    regions each run on ``1/d1`` of the tokens, and the next column-split layer all-gathers them: an all-gather
    and a reduce-scatter where there was an all-reduce, and ``1/d1`` of those activations per device."""

    def __post_init__(self) -> None:
        _check_mesh_shape(self.mesh_shape)
        _check_micro_batches(self.num_micro_batches)


@dataclass(kw_only=True, frozen=True)
class ShardParallel:
    """Intra-operator parallelism chosen by the sharding ILP on a 2-D logical mesh."""

    name: ClassVar[str] = "shard"
    """This method's name in ``Plan.method`` and on the command line."""

    mesh_shape: tuple[int, int] | tuple[int, int, int] | None = None
    """Logical mesh ``(d0, d1)``; ``None`` tries every factorization of the device count, keeps the cheapest.
    Three ints ``(data, d0, d1)`` add an outer data axis pinned to the batch: the ILP plans one replica's
    ``1/data`` of the rows on ``d0 × d1`` devices (e.g. context and tensor parallelism), and ``data`` such replicas
    train side by side, their gradients combined once per step (refused: a model that updates buffers in training,
    e.g. BatchNorm statistics, and a loss the replicas' losses do not make, e.g. a router's load-balancing loss:
    each replica would see its rows only)."""
    memory_budget: int | None = None
    """Bytes per device the plan may use; ``None`` = the cluster's device memory."""
    solver_time_limit_s: float = 30.0
    """CP-SAT time limit per solve; the plan reports the optimality gap reached."""

    num_micro_batches: int = 1
    """Gradient accumulation: the batch is cut into this many micro-batches (row ``i`` goes to micro-batch
    ``i mod num_micro_batches``) run one after another inside the step's executable; their gradients are summed
    on each device and synchronized once per step. The batch size must divide evenly."""
    experts: ExpertsOption = "auto"
    """Mixture-of-experts grouped matmuls: ``"auto"``, the ILP weighs splitting the experts over a mesh axis
    (expert parallelism: tokens exchanged by all-to-all) against replicating them, splitting their rows or their
    hidden dims. The others restrict every grouped matmul to one kind of layout, where it has one (the plan can
    only get slower by the cost model): ``"split"``, experts split over a mesh axis; ``"tensor"``, every expert's
    hidden dims split (tensor parallelism inside the experts); ``"replicated"``, every expert whole on every
    device."""
    context: ContextOption = "auto"
    """Attention over long sequences (``scaled_dot_product_attention`` with no mask operand and no dropout):
    ``"auto"``, the ILP weighs splitting its sequence over a mesh axis (context parallelism: keys and values
    all-gathered, or passed around a ring of devices; zig-zag chunks when causal) against splitting its batch or
    heads, pricing the ``L × S`` probabilities the whole-sequence attention keeps in memory; ``"allgather"`` or
    ``"ring"``: every attention whose sequence divides takes that split; ``"off"``: never split the sequence."""

    def __post_init__(self) -> None:
        _check_mesh_shape(self.mesh_shape, data_axis=True)
        _check_micro_batches(self.num_micro_batches)
        _check_experts(self.experts)
        _check_context(self.context)
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive bytes, got {self.memory_budget}")
        if self.solver_time_limit_s <= 0:
            raise ValueError(f"solver_time_limit_s must be positive, got {self.solver_time_limit_s}")


@dataclass(kw_only=True, frozen=True)
class AutoLayerOption:
    """Cluster the ops into ``layer_num`` layers of near-equal FLOPs."""

    layer_num: int
    """Number of layers to form."""
    eps: float = 0.5
    """Each layer's FLOPs stay within ``(1 + eps)`` × the mean."""

    def __post_init__(self) -> None:
        if self.layer_num < 1:
            raise ValueError(f"layer_num must be ≥ 1, got {self.layer_num}")
        if self.eps < 0:
            raise ValueError(f"eps must be ≥ 0, got {self.eps}")


@dataclass(kw_only=True, frozen=True)
class ManualStageOption:
    """Stages given by hand: which layers, on which submesh, with which logical mesh."""

    forward_stage_layer_ids: tuple[tuple[int, ...], ...]
    """Layer ids of each stage, contiguous and in order."""
    submesh_physical_shapes: tuple[tuple[int, int], ...]
    """(hosts, devices) of each stage's submesh."""
    submesh_logical_shapes: tuple[tuple[int, int], ...]
    """Logical mesh of each stage."""

    def __post_init__(self) -> None:
        n = len(self.forward_stage_layer_ids)
        if n == 0 or len(self.submesh_physical_shapes) != n or len(self.submesh_logical_shapes) != n:
            raise ValueError(
                "forward_stage_layer_ids, submesh_physical_shapes and submesh_logical_shapes "
                "must be non-empty and of equal length"
            )


PIPELINE_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1")
"""``PipeshardParallel.schedule`` values (their instruction lists: :mod:`torchpar.planner.pipeline.schedules`)."""


@dataclass(kw_only=True, frozen=True)
class PipeshardParallel:
    """Pipeline stages on submeshes (inter-op) with the ILP inside each stage (intra-op)."""

    name: ClassVar[str] = "pipeshard"
    """This method's name in ``Plan.method`` and on the command line."""

    num_micro_batches: int | Literal["auto"] = 1
    """Micro-batches per step; the batch dim must divide evenly. ``"auto"``: the planner tries the counts that divide
    the example batch's rows (powers of two, and one row per micro-batch), planning each, and keeps the fastest
    (:mod:`torchpar.planner.pipeline.micro_batch_counts`; ``plan.num_micro_batches``,
    ``plan.solver["micro_batches"]``)."""
    layer_option: AutoLayerOption | Literal["manual"] = AutoLayerOption(layer_num=2)
    """How ops are grouped into layers; ``"manual"`` cuts at ``mark_pipeline_boundary``."""
    stage_option: Literal["auto", "uniform"] | ManualStageOption = "auto"
    """How layers are grouped into stages and stages placed on submeshes."""
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zb_h1"] = "1f1b"
    """Pipeline schedule (:mod:`torchpar.planner.pipeline.schedules`): ``"1f1b"`` or ``"gpipe"``; ``"interleaved_1f1b"``
    (Megatron-LM's virtual stages: each device group runs ``virtual_stages`` non-adjacent stages; bubble
    ``(G−1)/(v·M+G−1)`` on G groups); ``"zb_h1"`` (zero bubble: each backward split into its input- and
    weight-gradient parts, the latter deferred; bubble ``(S−1)/(3M+S−1)`` when the parts cost the same)."""
    virtual_stages: int | None = None
    """Stages per device group under ``"interleaved_1f1b"`` (v ≥ 2; default 2): the plan has ``v·G`` stages,
    stage ``s`` on the devices of group ``s mod G``. Must stay ``None`` (= 1) for the other schedules."""
    experts: ExpertsOption = "auto"
    """Mixture-of-experts grouped matmuls inside each stage: as :attr:`ShardParallel.experts`."""
    context: ContextOption = "auto"
    """Attention's sequence split inside each stage: as :attr:`ShardParallel.context`."""

    def __post_init__(self) -> None:
        if self.num_micro_batches != "auto":
            _check_micro_batches(self.num_micro_batches, "or 'auto'")
        _check_experts(self.experts)
        _check_context(self.context)
        if self.schedule not in PIPELINE_SCHEDULES:
            names = ", ".join(map(repr, PIPELINE_SCHEDULES))
            raise ValueError(f"schedule must be one of {names}, got {self.schedule!r}")
        v = self.virtual_stages
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"virtual_stages must be an int ≥ 1, got {v!r}")
        if self.schedule == "interleaved_1f1b":
            if v == 1:
                raise ValueError(
                    "schedule='interleaved_1f1b' with virtual_stages=1 is schedule='1f1b'; give "
                    "virtual_stages ≥ 2 (the default, None, means 2)"
                )
            object.__setattr__(self, "virtual_stages", 2 if v is None else v)
        elif v not in (None, 1):
            raise ValueError(f"virtual_stages={v} needs schedule='interleaved_1f1b' (got {self.schedule!r})")
        if not isinstance(self.layer_option, AutoLayerOption) and self.layer_option != "manual":
            raise ValueError(f"layer_option must be AutoLayerOption(...) or 'manual', got {self.layer_option!r}")
        if not isinstance(self.stage_option, ManualStageOption) and self.stage_option not in ("auto", "uniform"):
            raise ValueError(
                f"stage_option must be 'auto', 'uniform' or ManualStageOption(...), got {self.stage_option!r}"
            )


Method = DataParallel | Zero2Parallel | Zero3Parallel | MegatronParallel | ShardParallel | PipeshardParallel

METHODS: dict[str, type | None] = {
    SINGLE_DEVICE: None,
    **{
        m.name: m
        for m in (DataParallel, Zero2Parallel, Zero3Parallel, MegatronParallel, ShardParallel, PipeshardParallel)
    },
}
"""Every method by its name (``"single_device"`` is ``method=None``)."""
METHOD_NAMES: tuple[str, ...] = tuple(METHODS)


def method_name(method: Method | None) -> str:
    """The one name of ``method`` (``None`` → ``"single_device"``)."""
    return SINGLE_DEVICE if method is None else method.name


ExpertsOption = Literal["auto", "split", "tensor", "replicated"]
EXPERTS_OPTIONS: tuple[str, ...] = ("auto", "split", "tensor", "replicated")


def _check_experts(experts: str) -> None:
    if experts not in EXPERTS_OPTIONS:
        raise ValueError(f"experts must be one of {EXPERTS_OPTIONS}, got {experts!r}")


ContextOption = Literal["auto", "allgather", "ring", "off"]
CONTEXT_OPTIONS: tuple[str, ...] = ("auto", "allgather", "ring", "off")


def _check_context(context: str) -> None:
    if context not in CONTEXT_OPTIONS:
        raise ValueError(f"context must be one of {CONTEXT_OPTIONS}, got {context!r}")


def _check_mesh_shape(mesh_shape: tuple[int, ...] | None, data_axis: bool = False) -> None:
    if mesh_shape is None:
        return
    lengths = (2, 3) if data_axis else (2,)
    if len(mesh_shape) not in lengths or any(isinstance(d, bool) or int(d) != d or int(d) < 1 for d in mesh_shape):
        what = "two positive ints (d0, d1) or three (data, d0, d1)" if data_axis else "two positive ints"
        raise ValueError(f"mesh_shape must be {what}, got {mesh_shape}")


def _check_micro_batches(num_micro_batches: int, alternative: str = "") -> None:
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        also = f" {alternative}" if alternative else ""
        raise ValueError(f"num_micro_batches must be an int ≥ 1{also}, got {num_micro_batches!r}")


def searches_micro_batches(method: object) -> bool:
    """Whether ``method`` leaves its micro-batch count to the planner
    (``PipeshardParallel(num_micro_batches="auto")``)."""
    return isinstance(method, PipeshardParallel) and method.num_micro_batches == "auto"


def data_replicas(method: object) -> int:
    """The data replicas a method asks for: the first int of a three-int ``mesh_shape``; a saved one-stage plan's
    ``stages[0].data_replicas``; else 1."""
    stages = getattr(method, "stages", None)
    if stages:
        return int(getattr(stages[0], "data_replicas", 1)) if len(stages) == 1 else 1
    shape = getattr(method, "mesh_shape", None)
    return int(shape[0]) if shape is not None and len(shape) == 3 else 1


def method_title(name: str) -> str:
    """``"shard"`` → ``"ShardParallel (shard)"``: the class a user writes, then the plan's method name;
    ``"single_device"`` → ``"single device"``."""
    cls = METHODS.get(name)
    return f"{cls.__name__} ({name})" if cls is not None else name.replace("_", " ")
