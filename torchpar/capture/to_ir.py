"""An exported program (reduced to core ATen by :mod:`.decompositions`) → the IR: the translation of the FX graph
and its signature into a :class:`torchpar.ir.Graph` (:func:`to_ir`). Shared by the model step's capture
(:mod:`.export`) and the backward of each custom ``autograd.Function``
(:mod:`torchpar.capture.semantics.autograd_functions`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, cast

import numpy as np
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from torchpar.capture.boundary import BOUNDARY_TARGET
from torchpar.capture.meta_models import is_without_data
from torchpar.ir.costs import op_flops
from torchpar.ir.graph import DType, Graph, Input, Node, OutMeta, Output, Ref, TensorMeta


def to_ir(
    exported: ExportedProgram,
    model: torch.nn.Module,
    *,
    user_output_kind: Literal["loss", "user"],
    aux_keys: tuple[str, ...] = (),
) -> Graph:
    """Translate the exported program's graph and signature into the IR. User outputs are of ``user_output_kind``,
    but for ``aux_keys``: the last ``len(aux_keys)`` user outputs are a ``step_fn``'s aux values (kind ``"aux"``, the
    key as target)."""
    signature = exported.graph_signature
    canonical = _canonical_param_names(model)
    inputs: list[Input] = []
    constants: dict[str, np.ndarray] = {}
    user_index = 0
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, signature.input_specs, strict=True):
        # a parameter, buffer, constant or batch input holds a tensor (any other kind is refused below)
        meta = cast(TensorMeta, _meta_of(node.meta.get("val")))
        target = _strip_wrapper(spec.target) if spec.target is not None else ""
        if spec.kind == InputKind.PARAMETER:
            inputs.append(Input(node.name, "param", canonical.get(target, target), meta))
        elif spec.kind == InputKind.BUFFER:
            inputs.append(Input(node.name, "buffer", target, meta))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constants[target] = _constant_value(exported.constants[spec.target])
            inputs.append(Input(node.name, "constant", target, meta))
        elif spec.kind == InputKind.USER_INPUT:
            inputs.append(Input(node.name, "input", str(user_index), meta))
            user_index += 1
        else:
            raise NotImplementedError(f"torch.export input kind {spec.kind.name} ({spec.target}) is not supported")
    metas: dict[str, OutMeta] = {i.name: i.meta for i in inputs}
    nodes: list[Node] = []
    for fx_node in exported.graph.nodes:
        if fx_node.op != "call_function":
            continue
        target = _target_name(fx_node.target)
        node = Node(
            name=fx_node.name,
            target=target,
            args=_convert(fx_node.args),
            kwargs={k: _convert(v) for k, v in fx_node.kwargs.items()},
            out=_meta_of(fx_node.meta.get("val")),
            source=_source_line(fx_node.meta.get("stack_trace")),
            module_path=_module_path(fx_node.meta.get("nn_module_stack")),
        )
        node = dataclasses.replace(node, flops=op_flops(target, [metas.get(r) for r in node.refs()], node.out))
        metas[node.name] = node.out
        nodes.append(node)
    output_node = next(n for n in exported.graph.nodes if n.op == "output")
    results = output_node.args[0]
    outputs: list[Output] = []
    num_user = sum(spec.kind == OutputKind.USER_OUTPUT for spec in signature.output_specs)
    user_index = 0
    for value, spec in zip(results, signature.output_specs, strict=True):
        ref = Ref(value.name) if isinstance(value, torch.fx.Node) else None
        if spec.kind == OutputKind.BUFFER_MUTATION:
            outputs.append(Output("buffer", ref, _strip_wrapper(spec.target)))
        elif spec.kind == OutputKind.USER_OUTPUT:
            aux = user_index - (num_user - len(aux_keys))
            outputs.append(Output("aux", ref, aux_keys[aux]) if aux >= 0 else Output(user_output_kind, ref))
            user_index += 1
        else:
            raise NotImplementedError(
                f"torch.export output kind {spec.kind.name} ({spec.target}) is not supported: the model "
                "mutates one of its inputs in place; clone the input before mutating it"
            )
    graph = Graph(inputs=inputs, nodes=nodes, outputs=outputs, constants=constants)
    graph.validate()
    return graph


def _canonical_param_names(model: torch.nn.Module) -> dict[str, str]:
    """Every name a parameter is reachable under → its first ``named_parameters()`` name."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters():
        first.setdefault(id(param), name)
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def _strip_wrapper(target: str) -> str:
    return target.removeprefix("model.")


def _target_name(target: object) -> str:
    if target is BOUNDARY_TARGET:
        return "torchpar.pipeline_boundary"
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace == "torchpar":  # torchpar's own markers: torchpar.<name> (one overload each)
            return f"torchpar.{target._opname}"
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else str(target)
    if getattr(target, "__name__", None) == "getitem":
        return "getitem"
    return str(target)


def _convert(value: object) -> Any:
    """fx argument → IR argument (see :mod:`torchpar.ir.graph`)."""
    if isinstance(value, torch.fx.Node):
        return Ref(value.name)
    if isinstance(value, torch.dtype):
        return DType(dtype_name(value))
    if isinstance(value, (torch.device, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, list):  # fx's immutable_list too: the IR holds plain lists (a worker unpickles no torch)
        return [_convert(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_convert(v) for v in value)
    if isinstance(value, (int, float, bool, str)) or value is None:
        return value
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise NotImplementedError(f"symbolic value {value} in the exported graph: torchpar compiles static shapes")
    raise NotImplementedError(f"unsupported argument of type {type(value).__name__} in the exported graph: {value!r}")


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host copy of ``tensor``; bfloat16 becomes ``ml_dtypes.bfloat16`` (numpy has no bf16 of its own)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.float().numpy().astype(ml_dtypes.bfloat16)
    return tensor.numpy()


def _constant_value(tensor: torch.Tensor) -> np.ndarray:
    """A constant's host value; a constant on the meta device (a model built there, to be planned, never run) has
    none: a read-only array of its shape and dtype, all zeros, that takes no memory (a broadcast scalar)."""
    if is_without_data(tensor):
        return np.broadcast_to(tensor_to_numpy(torch.zeros((), dtype=tensor.dtype)), tuple(tensor.shape))
    return tensor_to_numpy(tensor)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(s) for s in tensor.shape), dtype_name(tensor.dtype))


def _meta_of(value: object) -> OutMeta:
    if isinstance(value, torch.Tensor):
        return tensor_meta(value)
    if isinstance(value, (list, tuple)):
        return tuple(tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in value)
    return None


def _source_line(stack_trace: str | None) -> str:
    """The innermost frame of the user's (or the model library's) code, not torch's own."""
    if not stack_trace:
        return ""
    lines = stack_trace.strip().splitlines()
    frames = [
        (lines[i].strip(), lines[i + 1].strip() if i + 1 < len(lines) else "")
        for i in range(len(lines))
        if lines[i].lstrip().startswith("File ")
    ]
    user_frames = [
        f
        for f in frames
        if "/torch/" not in f[0] and "torchpar/capture" not in f[0] and "torchpar/__init__.py" not in f[0]
    ]
    frame, code = (user_frames or frames or [("", "")])[-1]
    location = frame.removeprefix("File ").replace('", line ', ":").replace('"', "")
    return f"{location}: {code}" if code else location


def _module_path(stack: dict[str, tuple[str, object]] | None) -> str:
    if not stack:
        return ""
    path = list(stack.values())[-1][0]  # under the capture wrapper's attribute "model"
    return "" if path == "model" else path.removeprefix("model.")
