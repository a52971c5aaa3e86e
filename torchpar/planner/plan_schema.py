"""The check of a plan's JSON form (``docs/api.md``, ``Plan``) that :meth:`Plan.from_dict` runs before it builds
anything.

A plan file is untrusted input: it is read with ``json`` only (never pickle or ``eval``), and every field is
checked here against the format ``Plan.to_dict()`` writes. A bad field raises :class:`PlanFormatError`, whose
message names the field by its path (``stages[1].logical_mesh_shape``, ``stages[0].params["fc.weight"][1]``),
what it must be and what was found::

    plan field stages[0].submesh_shape must be a list of 2 positive ints, got [1, 'a']

The checks cover types and values of every field (unknown keys included) and the few facts that tie fields
together: a one-stage method has one stage, a pipeline names its schedule, each stage's logical mesh holds its
submesh's devices, and its device ids are distinct, in the cluster and as many as its logical mesh has.
Whether the plan fits a given model is checked where it is compiled, not here.
"""

from __future__ import annotations

import json
import math
import numbers
import reprlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn, Required, TypedDict, TypeGuard, cast

from torchpar.methods import METHOD_NAMES, PIPELINE_SCHEDULES, PipeshardParallel
from torchpar.planner.remat import REMAT_OPTIONS

FORMER_METHOD_NAMES: dict[str, str] = {"auto": "shard"}
"""Method names of plans saved by earlier versions → today's (:data:`torchpar.methods.METHOD_NAMES`)."""
SCHEDULE_NAMES: tuple[str, ...] = ("none", *PIPELINE_SCHEDULES)
"""``Plan.schedule`` values: ``"none"`` for one-stage plans, a pipeline schedule otherwise."""
MESH_AXES: tuple[int, ...] = (0, 1)
MAX_SOLVER_DEPTH = 16
"""How deeply ``Plan.solver`` (free-form statistics) may nest."""

_SPEC = "a spec (a list with one entry per tensor dim, each null or a list of mesh axes 0/1)"
_ENTRY = "null or a list of distinct mesh axes (0 or 1)"
_MESH = "a list of 2 positive ints"

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 3, 60, 60, 8, 6


class PlanFormatError(ValueError):
    """A plan (file, JSON text or dict) that is not a valid plan. ``field`` is the path of the bad field
    (``""``: the plan as a whole; ``None``: the text is not JSON); the message says what was expected and what
    was found."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def validate_plan_dict(data: object) -> None:
    """Check ``data``, a plan's JSON form (``json.loads`` of a plan file, or ``Plan.to_dict()``), field by field.

    Returns ``None`` when :meth:`Plan.from_dict` can build the plan; raises :class:`PlanFormatError` naming the
    first bad field otherwise. Reads ``data`` only; never evaluates anything in it.
    """
    if not isinstance(data, Mapping):
        raise PlanFormatError(
            f"a plan must be a JSON object of fields, got {type(data).__name__} {_show(data)}", field=""
        )
    _check_fields("", data, PLAN_FIELDS, what="a plan")
    _check_plan_consistency(cast(_CheckedPlan, data))


# --- the two records: a plan and its stages ----------------------------------------------------------


class _CheckedStage(TypedDict, total=False):
    """The fields of a stage that passed their checks (:data:`STAGE_FIELDS`), as the checks that tie them read them."""

    submesh_shape: Required[Sequence[int]]
    logical_mesh_shape: Required[Sequence[int]]
    data_replicas: int
    device_ids: Sequence[int]


class _CheckedCluster(TypedDict, total=False):
    """The fields of a plan's cluster that passed their checks (:data:`CLUSTER_FIELDS`) and tie to its stages."""

    num_hosts: int
    devices_per_host: int


class _CheckedPlan(TypedDict, total=False):
    """The fields of a plan that passed their checks (:data:`PLAN_FIELDS`), as the checks that tie them read them."""

    method: Required[str]
    stages: Required[Sequence[_CheckedStage]]
    schedule: str
    cluster: _CheckedCluster


Check = Callable[[str, object], None]
"""Checks the value at a field path; raises :class:`PlanFormatError` if it is bad."""


def _check_fields(
    path: str, data: Mapping[str, object], fields: Mapping[str, tuple[bool, Check]], *, what: str
) -> None:
    """Every key of ``data`` is one of ``fields`` (name → (required, check)), every required one is there, and
    each passes its check; ``what`` names the record in messages (``a plan``, ``a stage``)."""
    for key in data:
        if key not in fields:
            raise PlanFormatError(
                f"plan field {_field(path, key)} is unknown; {what} has the fields {', '.join(sorted(fields))}",
                field=_field(path, key),
            )
    for name, (required, check) in fields.items():
        if name in data:
            check(_field(path, name), data[name])
        elif required:
            raise PlanFormatError(
                f"plan field {_field(path, name)} is missing; {what} requires "
                f"{', '.join(n for n, (r, _) in fields.items() if r)}",
                field=_field(path, name),
            )


def _check_stages(path: str, value: object) -> None:
    """A non-empty list of stage objects, each with valid fields, meshes and devices."""
    stages = _list(path, value, "a non-empty list of stage objects")
    if not stages:
        _fail(path, "a non-empty list of stage objects", value)
    for index, stage in enumerate(stages):
        where = f"{path}[{index}]"
        if not isinstance(stage, Mapping):
            _fail(where, "a stage object", stage)
        _check_fields(where, stage, STAGE_FIELDS, what="a stage")
        _check_stage_devices(where, cast(_CheckedStage, stage))


def _check_stage_devices(path: str, stage: _CheckedStage) -> None:
    """The logical mesh holds the submesh's devices, and ``device_ids`` (if any) lists that many distinct ones."""
    submesh, logical = stage["submesh_shape"], stage["logical_mesh_shape"]
    count = math.prod(logical) * stage.get("data_replicas", 1)
    if math.prod(submesh) != count:
        _fail(
            f"{path}.logical_mesh_shape",
            f"a mesh of the submesh's {math.prod(submesh)} devices (submesh_shape {list(submesh)})",
            logical,
        )
    devices = stage.get("device_ids", [])
    if devices and len(devices) != count:
        _fail(
            f"{path}.device_ids",
            f"empty or {count} device ids, one per device of the logical mesh {list(logical)}",
            devices,
        )
    repeated = sorted(d for d, n in Counter(devices).items() if n > 1)
    if repeated:
        _fail(f"{path}.device_ids", f"distinct device ids (device {repeated[0]} is listed twice)", devices)


def _check_plan_consistency(data: _CheckedPlan) -> None:
    """Facts that tie fields together: stage count and schedule by method, device ids within the cluster."""
    method = FORMER_METHOD_NAMES.get(data["method"], data["method"])
    stages = data["stages"]
    if method == PipeshardParallel.name:
        schedule = data.get("schedule", "none")
        if schedule not in PIPELINE_SCHEDULES:
            default = "" if "schedule" in data else " (the default: the field is missing)"
            _fail(
                "schedule",
                f"one of {_names(PIPELINE_SCHEDULES)} for a {method} plan",
                schedule,
                shown=_show(schedule) + default,
            )
    elif len(stages) != 1:
        _fail(
            "stages",
            f"a list of exactly 1 stage for a {method} plan (only pipeshard plans have more)",
            len(stages),
            shown=f"{len(stages)} stages",
        )
    cluster = data.get("cluster") or {}
    if not cluster:
        return
    total = cluster.get("num_hosts", 1) * cluster.get("devices_per_host", 1)
    where = f"the plan's cluster ({cluster.get('num_hosts', 1)} host(s) × {cluster.get('devices_per_host', 1)})"
    for index, stage in enumerate(stages):
        if math.prod(stage["logical_mesh_shape"]) * stage.get("data_replicas", 1) > total:
            _fail(
                f"stages[{index}].logical_mesh_shape",
                f"a mesh of at most the {total} devices of {where}",
                stage["logical_mesh_shape"],
            )
        outside = [d for d in stage.get("device_ids", []) if d >= total]
        if outside:
            _fail(f"stages[{index}].device_ids", f"device ids below {total}, the devices of {where}", outside[0])


# --- field checks --------------------------------------------------------------------------------------


def _check_method(path: str, value: object) -> None:
    """One of :data:`METHOD_NAMES`, or a former name still read (``"auto"``)."""
    if not isinstance(value, str) or value not in (*METHOD_NAMES, *FORMER_METHOD_NAMES):
        _fail(path, f"one of {_names(METHOD_NAMES)} (or a former name: {_names(FORMER_METHOD_NAMES)})", value)


def _check_schedule(path: str, value: object) -> None:
    if not isinstance(value, str) or value not in SCHEDULE_NAMES:
        _fail(path, f"one of {_names(SCHEDULE_NAMES)}", value)


def _check_positive_int(path: str, value: object) -> None:
    if not _is_int(value) or value < 1:
        _fail(path, "an int ≥ 1", value)


def _check_count(path: str, value: object) -> None:
    if not _is_int(value) or value < 0:
        _fail(path, "an int ≥ 0", value)


def _check_number(path: str, value: object) -> None:
    if not _is_number(value):
        _fail(path, "a number", value)


def _check_mesh_shape(path: str, value: object) -> None:
    if not _is_list(value) or len(value) != 2 or not all(_is_int(d) and int(d) >= 1 for d in value):
        _fail(path, _MESH, value)


def _check_ids(path: str, value: object, *, what: str, non_empty: bool) -> None:
    """A list of ints ≥ 0 (layer ids, device ids), non-empty if ``non_empty``; their callers check they are
    distinct."""
    expected = f"a {'non-empty ' if non_empty else ''}list of {what} (ints ≥ 0)"
    items = _list(path, value, expected)
    if non_empty and not items:
        _fail(path, expected, value)
    for index, item in enumerate(items):
        if not _is_int(item) or item < 0:
            _fail(f"{path}[{index}]", f"one of the {what}: an int ≥ 0", item)


def _check_layers(path: str, value: object) -> None:
    _check_ids(path, value, what="layer ids", non_empty=True)
    layers = cast(Sequence[int], value)  # a list of ints, as _check_ids found
    repeated = sorted(d for d, n in Counter(layers).items() if n > 1)
    if repeated:
        _fail(path, f"distinct layer ids (layer {repeated[0]} is listed twice)", value)


def _check_device_ids(path: str, value: object) -> None:
    _check_ids(path, value, what="device ids", non_empty=False)


def _check_spec(path: str, value: object) -> None:
    """A spec: per dim null or distinct mesh axes, each axis splitting at most one dim."""
    entries = _list(path, value, _SPEC)
    for index, entry in enumerate(entries):
        if entry is None:
            continue
        if (
            not _is_list(entry)
            or not all(_is_int(a) and a in MESH_AXES for a in entry)
            or len(set(entry)) != len(entry)
        ):
            _fail(f"{path}[{index}]", _ENTRY, entry)
    checked = cast(Sequence[Sequence[int] | None], entries)  # each entry passed the check above
    used = [axis for entry in checked if entry for axis in entry]
    if len(used) != len(set(used)):
        _fail(path, f"{_SPEC} that splits at most one dim over each mesh axis", value)


def _check_value_spec(path: str, value: object) -> None:
    """An activation's layout: a spec, or for a multi-output op one spec (or null) per result."""
    if _is_list(value) and any(_is_list(entry) and any(a is None or _is_list(a) for a in entry) for entry in value):
        for index, spec in enumerate(value):
            if spec is not None:
                _check_spec(f"{path}[{index}]", spec)
    else:
        _check_spec(path, value)


def _check_operand_specs(path: str, value: object) -> None:
    """The layouts an op reads its operands in: one spec (or null for a non-tensor operand) per operand."""
    for index, spec in enumerate(_list(path, value, f"a list of operand layouts, each null or {_SPEC}")):
        if spec is not None:
            _check_spec(f"{path}[{index}]", spec)


def _check_solver(path: str, value: object) -> None:
    """Free-form statistics: an object of plain JSON values, nested at most :data:`MAX_SOLVER_DEPTH` deep."""
    _object(path, value, "an object of solver statistics")
    _check_json_value(path, value, MAX_SOLVER_DEPTH)


def _check_json_value(path: str, value: object, depth: int) -> None:
    if isinstance(value, (str, bool, numbers.Real)) or value is None:
        return
    if depth <= 0:
        _fail(path, f"JSON nested at most {MAX_SOLVER_DEPTH} levels deep", value)
    if isinstance(value, Mapping):
        for key, item in _object(path, value, "a JSON object").items():
            _check_json_value(_key(path, key), item, depth - 1)
    elif _is_list(value):
        for index, item in enumerate(value):
            _check_json_value(f"{path}[{index}]", item, depth - 1)
    else:
        _fail(path, "a JSON value (string, number, bool, null, list or object)", value)


def _check_cluster(path: str, value: object) -> None:
    """The cluster the plan was made for (``ClusterSpec.cost_constants``): ``num_hosts`` and ``devices_per_host``
    (ints ≥ 1) and the cost constants it was priced with; empty if unknown."""
    _check_fields(
        path, _object(path, value, "an object with num_hosts and devices_per_host"), CLUSTER_FIELDS, what="a cluster"
    )


def _check_layer_stats(path: str, value: object) -> None:
    """Per pipeline layer: an object with the numbers ``flops`` and ``activation_bytes``."""
    for index, row in enumerate(_list(path, value, "a list of per-layer objects {flops, activation_bytes}")):
        where = f"{path}[{index}]"
        _check_fields(
            where,
            _object(where, row, "an object {flops, activation_bytes}"),
            LAYER_STAT_FIELDS,
            what="a layer's statistics",
        )


def _mapping_of(check: Check, what: str) -> Check:
    """A check of an object whose values each pass ``check`` (``what``: the object's description)."""

    def check_mapping(path: str, value: object) -> None:
        for key, item in _object(path, value, what).items():
            check(_key(path, key), item)

    return check_mapping


def _check_axis_pair(path: str, value: object) -> None:
    """Two non-negative numbers, one per logical mesh axis."""
    if not _is_list(value) or len(value) != 2:
        _fail(path, "a list of two numbers (mesh axis 0, axis 1)", value)
    for index, item in enumerate(value):
        _check_number(f"{path}[{index}]", item)


def _check_axis_flags(path: str, value: object) -> None:
    """Two booleans, one per logical mesh axis, or empty (unknown)."""
    if not _is_list(value) or len(value) not in (0, 2) or not all(isinstance(v, bool) for v in value):
        _fail(path, "a list of two booleans (mesh axis 0, axis 1), or empty", value)


def _check_str_list(path: str, value: object) -> None:
    for index, item in enumerate(_list(path, value, "a list of strings")):
        _check_str(f"{path}[{index}]", item)


def _check_optional_str(path: str, value: object) -> None:
    if value is not None:
        _check_str(path, value)


def _check_str(path: str, value: object) -> None:
    if not isinstance(value, str):
        _fail(path, "a string", value)


def _check_remat(path: str, value: object) -> None:
    if value not in REMAT_OPTIONS:
        _fail(path, f"one of {', '.join(REMAT_OPTIONS)}", value)


_SPECS = _mapping_of(_check_spec, f"an object of name → {_SPEC}")

PLAN_FIELDS: dict[str, tuple[bool, Check]] = {
    "method": (True, _check_method),
    "stages": (True, _check_stages),
    "num_micro_batches": (False, _check_positive_int),
    "schedule": (False, _check_schedule),
    "estimated_step_s": (False, _check_number),
    "solver": (False, _check_solver),
    "timings": (False, _mapping_of(_check_number, "an object of phase name → seconds")),
    "layers": (False, _check_layer_stats),
    "cluster": (False, _check_cluster),
    "layer_of_node": (False, _mapping_of(_check_count, "an object of node name → layer id")),
    "numerics": (False, _mapping_of(_check_str, "an object of setting → string")),
    "remat": (False, _check_remat),
}
"""The fields of a plan (``Plan``'s dataclass fields): name → (required, check)."""

STAGE_FIELDS: dict[str, tuple[bool, Check]] = {
    "layers": (True, _check_layers),
    "submesh_shape": (True, _check_mesh_shape),
    "logical_mesh_shape": (True, _check_mesh_shape),
    "params": (True, _SPECS),
    "estimated_cost_s": (True, _check_number),
    "estimated_compute_s": (False, _check_number),
    "estimated_communication_s": (False, _check_number),
    "estimated_memory_bytes": (False, _check_count),
    "grads": (False, _SPECS),
    "optimizer_state": (False, _SPECS),
    "params_at_use": (False, _SPECS),
    "inputs": (False, _SPECS),
    "activations": (False, _mapping_of(_check_value_spec, f"an object of node name → {_SPEC}")),
    "operands": (False, _mapping_of(_check_operand_specs, "an object of node name → operand layouts")),
    "strategies": (False, _mapping_of(_check_str, "an object of node name → strategy description")),
    "op_options": (
        False,
        _mapping_of(
            _mapping_of(_check_str, "an object of option → value"), "an object of node name → lowering options"
        ),
    ),
    "data_replicas": (False, _check_positive_int),
    "device_ids": (False, _check_device_ids),
    "memory_breakdown": (False, _mapping_of(_check_number, "an object of part (parameters, …) → bytes per device")),
    "communication_bytes": (False, _mapping_of(_check_number, "an object of collective kind → bytes per device")),
    "crosses_hosts": (False, _check_axis_flags),
    "compiled_memory_bytes": (False, lambda path, value: None if value is None else _check_count(path, value)),
    "measured_cost_s": (False, lambda path, value: None if value is None else _check_number(path, value)),
}
"""The fields of a stage (``StagePlan``'s dataclass fields): name → (required, check)."""

CLUSTER_FIELDS: dict[str, tuple[bool, Check]] = {
    "num_hosts": (False, _check_positive_int),
    "devices_per_host": (False, _check_positive_int),
    "device_flops": (False, _check_number),
    "device_memory_bytes": (False, _check_number),
    "alpha": (False, _check_axis_pair),
    "beta": (False, _check_axis_pair),
    "inter_host_alpha": (False, _check_number),
    "inter_host_beta": (False, _check_number),
    "preset": (False, _check_optional_str),
}
LAYER_STAT_FIELDS: dict[str, tuple[bool, Check]] = {
    "flops": (False, _check_number),
    "activation_bytes": (False, _check_number),
    "modules": (False, _check_str_list),
}


# --- small helpers ---------------------------------------------------------------------------------------


def _fail(path: str, expected: str, found: object, *, shown: str | None = None) -> NoReturn:
    """Raise the error for the field at ``path``: it must be ``expected`` and is ``found`` (described as
    ``shown``, by default its shortened repr)."""
    raise PlanFormatError(f"plan field {path} must be {expected}, got {shown or _show(found)}", field=path)


def _show(value: object) -> str:
    """``value`` for a message: its repr, cut short."""
    return _repr.repr(value)


def _field(path: str, name: object) -> str:
    """The path of a record's field: ``method`` at the top, ``stages[0].params`` below."""
    return f"{path}.{name}" if path else str(name)


def _key(path: str, key: object) -> str:
    """The path of an object's entry: ``stages[0].params["fc.weight"]``."""
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _names(names: Sequence[str] | Mapping[str, object]) -> str:
    return ", ".join(repr(n) for n in names)


def _is_int(value: object) -> TypeGuard[numbers.Integral]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[numbers.Real]:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _is_list(value: object) -> TypeGuard[list[object] | tuple[object, ...]]:
    """A JSON array: a list (or a tuple, as ``Plan.to_dict()`` leaves some)."""
    return isinstance(value, (list, tuple))


def _list(path: str, value: object, expected: str) -> Sequence[object]:
    if not _is_list(value):
        _fail(path, expected, value)
    return value


def _object(path: str, value: object, expected: str) -> Mapping[str, object]:
    """``value`` if it is an object with string keys (as JSON has)."""
    if not isinstance(value, Mapping):
        _fail(path, expected, value)
    for key in value:
        if not isinstance(key, str):
            _fail(path, f"{expected} with string keys", key)
    return value
