"""torch.export capture: ``nn.Module`` + example batch → :class:`torchpar.ir.Graph`.

The model is wrapped so that the exported program computes exactly what the user's loop computes:
``model(**batch)`` / ``model(*batch)`` / ``model(batch)``, then the loss selected as DESIGN.md §2
states; or, given a ``step_fn(model, batch) -> loss`` (``forward_fn(model, batch) -> outputs`` for the eval
forward), that function, which calls the model its own way. Export is non-strict, then ``run_decompositions()`` reduces the graph to core ATen, except
``scaled_dot_product_attention``, which stays one op (a fused lowering, one node for the planner); a
mask it receives that is the same for every batch (causal or all True) becomes its ``is_causal`` flag
(:mod:`torchpar.capture.attention_masks`).

Parameters and buffers are keyed by their ``named_parameters()`` / ``named_buffers()`` names. Tied
parameters (GPT-2 ``lm_head.weight`` is ``transformer.wte.weight``) are two placeholders with one
target, so the lowered function reads one array twice and ``jax.grad`` sums both gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from torchpar.capture.attention_masks import fold_static_attention_masks
from torchpar.capture.autograd_functions import capture_autograd_functions
from torchpar.capture.boundary import BOUNDARY_TARGET
from torchpar.capture.errors import CaptureError, dynamic_shape_error, translate_export_error
from torchpar.capture.grad_semantics import (autograd_capture_guards, check_gradient_hooks, mark_stop_gradients,
                                             module_modes, restore_module_modes)
from torchpar.capture.meta_models import as_fake_cpu, is_without_data, on_meta_device
from torchpar.capture.precision import autocast_device
from torchpar.ir.costs import op_flops
from torchpar.ir.graph import DType, Graph, Input, Node, Output, Ref, TensorMeta

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]
StepFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``step_fn(model, batch) -> scalar loss``: calls the model as it likes (``compile(step_fn=...)``)."""
ForwardFn = Callable[[torch.nn.Module, Any], Any]
"""``forward_fn(model, batch) -> outputs``: the eval forward's call of the model (``compile(forward_fn=...)``)."""

# Ops kept whole instead of decomposed to core ATen (each has a direct lowering).
_KEEP_UNDECOMPOSED = ("scaled_dot_product_attention.default",)


@dataclasses.dataclass
class Capture:
    """An exported model step.

    ``graph`` is the IR. ``in_spec`` is the pytree spec of ``(args, kwargs)`` the model was called
    with; user inputs of the graph are its leaves in order, with metas ``input_metas``.
    ``out_spec`` unflattens the graph's user outputs (eval capture). ``export_s`` and
    ``decompose_s`` are the seconds spent in ``torch.export`` and ``run_decompositions``.
    """

    graph: Graph
    in_spec: pytree.TreeSpec
    input_metas: list[TensorMeta]
    out_spec: pytree.TreeSpec | None
    export_s: float
    decompose_s: float


def batch_to_call_args(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The calling convention: dict → ``model(**batch)``, tuple/list → ``model(*batch)``, else
    ``model(batch)``."""
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def call_args_to_batch(batch_type: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Inverse of :func:`batch_to_call_args`, for handing the batch to a ``loss_fn``."""
    if issubclass(batch_type, dict):
        return kwargs
    if issubclass(batch_type, tuple) and hasattr(batch_type, "_fields"):  # a namedtuple
        return batch_type(*args)
    if issubclass(batch_type, (tuple, list)):
        return batch_type(args)
    return args[0]


def select_loss(outputs: Any, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The training loss: ``loss_fn(outputs, batch)`` if given, else a scalar output, else
    ``outputs.loss`` / ``outputs["loss"]``."""
    if loss_fn is not None:
        loss = loss_fn(outputs, batch)
    elif isinstance(outputs, torch.Tensor):
        loss = outputs
    elif getattr(outputs, "loss", None) is not None:
        loss = outputs.loss
    elif isinstance(outputs, dict) and outputs.get("loss") is not None:
        loss = outputs["loss"]
    else:
        raise ValueError(
            f"cannot find the loss in the model output of type {type(outputs).__name__}: return a scalar "
            "tensor, an object with .loss / ['loss'] (for HF models pass labels in the batch), or pass "
            "loss_fn=lambda outputs, batch: ... to torchpar.compile")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) in loss_fn")
    return loss


def check_model_fn(fn: Any, name: str) -> None:
    """A ``TypeError`` unless ``fn`` is a callable taking exactly ``(model, batch)`` (checked with
    :func:`inspect.signature`, before anything is traced); ``name`` is the keyword it was given as."""
    if not callable(fn):
        raise TypeError(f"{name} must be a function (model, batch) -> ..., got a {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its call will tell
        return
    try:
        signature.bind(object(), object())
    except TypeError as error:
        raise TypeError(f"{name} must take exactly two positional arguments (model, batch); "
                        f"{getattr(fn, '__name__', name)}{signature} cannot be called so ({error}). "
                        f"Write it as def {name}(model, batch): ...") from None


def _scalar_loss(loss: Any, name: str) -> torch.Tensor:
    """``loss`` if it is a scalar tensor, else an error saying what ``name`` returned instead."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{name} must return the loss as a scalar torch.Tensor, got a {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(f"{name} must return a scalar loss, got a tensor of shape {list(loss.shape)}; reduce it "
                         "(e.g. .mean(), or F.cross_entropy's default reduction='mean')")
    return loss


class _StepFnModule(torch.nn.Module):
    """Calls ``step_fn(model, batch)`` and returns its scalar loss (the exported training step of
    ``compile(step_fn=...)``). The model is the child ``model``, so its parameters keep their names once the
    ``model.`` prefix is stripped, as with :class:`_LossModule`."""

    def __init__(self, model: torch.nn.Module, batch_type: type, step_fn: StepFn):
        super().__init__()
        self.model = model
        self._batch_type = batch_type
        self._step_fn = step_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _scalar_loss(self._step_fn(self.model, call_args_to_batch(self._batch_type, args, kwargs)), "step_fn")


class _ForwardFnModule(torch.nn.Module):
    """Calls ``forward_fn(model, batch)`` and returns what it returns (the eval forward of
    ``compile(forward_fn=...)``)."""

    def __init__(self, model: torch.nn.Module, batch_type: type, forward_fn: ForwardFn):
        super().__init__()
        self.model = model
        self._batch_type = batch_type
        self._forward_fn = forward_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_fn(self.model, call_args_to_batch(self._batch_type, args, kwargs))


class _LossModule(torch.nn.Module):
    """Calls the user's model and returns the scalar loss (the exported training step)."""

    def __init__(self, model: torch.nn.Module, batch_type: type, loss_fn: LossFn | None):
        super().__init__()
        self.model = model
        self._batch_type = batch_type
        self._loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        outputs = self.model(*args, **kwargs)
        return select_loss(outputs, call_args_to_batch(self._batch_type, args, kwargs), self._loss_fn)


class _ForwardModule(torch.nn.Module):
    """Calls the user's model and returns its outputs unchanged (the exported eval forward)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


def capture_train_step(model: torch.nn.Module, batch: Any, loss_fn: LossFn | None = None, *,
                       autocast: torch.dtype | None = None, step_fn: StepFn | None = None) -> Capture:
    """Export ``model`` in train mode on ``batch`` into a graph whose single output is the loss
    (plus the new values of mutated buffers). ``step_fn``: the loss is ``step_fn(model, batch)`` instead of the
    calling convention and ``loss_fn`` (not both).

    ``autocast``: export under ``torch.autocast(device, autocast)``, ``device`` the type of the device the model
    lives on (:func:`torchpar.capture.precision.autocast_device`), so PyTorch's own casting policy (which ops
    run in the low dtype, which stay float32) is in the graph as explicit casts; the parameters stay in their
    dtype (the float32 master weights of mixed precision), and the backward ``jax.grad`` derives casts their
    gradients back."""
    if step_fn is not None:
        if loss_fn is not None:
            raise ValueError("pass step_fn or loss_fn, not both: step_fn(model, batch) returns the loss itself")
        wrapper: torch.nn.Module = _StepFnModule(model, type(batch), step_fn)
    else:
        wrapper = _LossModule(model, type(batch), loss_fn)
    return _capture(wrapper, model, batch, training=True, autocast=autocast, own_call=step_fn is not None)


def capture_forward(model: torch.nn.Module, batch: Any, *, autocast: torch.dtype | None = None,
                    forward_fn: ForwardFn | None = None) -> Capture:
    """Export ``model`` in eval mode on ``batch``; the graph's outputs are the model's outputs (``forward_fn``:
    ``forward_fn(model, batch)``'s). ``autocast`` as in :func:`capture_train_step`.

    HuggingFace models are exported with ``config.use_cache = False``: a KV cache object is not a tensor
    output (and training-style evaluation does not need it)."""
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False
    try:
        wrapper = _ForwardModule(model) if forward_fn is None else _ForwardFnModule(model, type(batch), forward_fn)
        return _capture(wrapper, model, batch, training=False, autocast=autocast, own_call=forward_fn is not None)
    finally:
        if use_cache:
            config.use_cache = use_cache


def _capture(wrapper: torch.nn.Module, model: torch.nn.Module, batch: Any, *, training: bool,
             autocast: torch.dtype | None = None, own_call: bool = False) -> Capture:
    args, kwargs = batch_to_call_args(batch)
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    for path, leaf in zip(_leaf_paths(args, kwargs), leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"batch entry {path} is a {type(leaf).__name__}; every batch leaf must be a tensor")
    args, kwargs = _unaliased(args, kwargs)
    if training:
        check_gradient_hooks(model)
    modes = module_modes(model)
    if not training:  # the eval forward; a training step keeps each submodule's mode as the user left it
        model.eval()
    try:
        # autocast must be on for the export and for the decomposition that re-traces it to ATen (where the
        # dispatcher inserts its casts); the exported program itself does not record an ambient autocast
        casting = (torch.autocast(autocast_device(model, leaves), autocast) if autocast is not None
                   else contextlib.nullcontext())
        # a meta model has no autocast dispatch: under autocast it is captured as fake CPU tensors (meta_models)
        fake_cpu = (as_fake_cpu(model, args, kwargs) if autocast is not None and on_meta_device(model)
                    else contextlib.nullcontext((args, kwargs)))
        with casting, fake_cpu as (args, kwargs):
            t0 = time.perf_counter()
            with torch.no_grad() if not training else contextlib.nullcontext(), autograd_capture_guards():
                with capture_autograd_functions(enabled=training) as functions:
                    exported = _export(wrapper, args, kwargs, model, batch, own_call=own_call)
            if training:
                stops = mark_stop_gradients(exported)
                if stops:
                    log.info("%d stop-gradient(s) (detach, no_grad regions) kept in the training graph", stops)
            t1 = time.perf_counter()
            table = torch.export.default_decompositions()
            for op in list(table):
                if str(op).removeprefix("aten.") in _KEEP_UNDECOMPOSED:
                    del table[op]
            exported = exported.run_decompositions(table)
            t2 = time.perf_counter()
    finally:
        restore_module_modes(model, modes)
    folded = fold_static_attention_masks(exported.graph)
    if folded:
        log.info("%d attention call(s) take a constant causal / full mask: folded into is_causal", folded)
    graph = _to_ir(exported, model, user_output_kind="loss" if training else "user")
    if functions.calls:  # custom autograd.Function backwards, each its own graph
        graph = graph.replace(custom_backwards=functions.backward_graphs(model))
        graph.validate()
    log.info("captured %s graph: %d ops (export %.2fs, decompose %.2fs)",
             "train" if training else "eval", len(graph.nodes), t1 - t0, t2 - t1)
    return Capture(
        graph=graph,
        in_spec=in_spec,
        input_metas=[_tensor_meta(leaf) for leaf in leaves],
        out_spec=None if training else exported.call_spec.out_spec,
        export_s=t1 - t0,
        decompose_s=t2 - t1,
    )


def _unaliased(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call arguments with every repeated tensor object (``{"input_ids": ids, "labels": ids}``) cloned:
    torch.export would make one graph input of both, and a later batch whose two entries differ would feed
    one of them to both uses."""
    seen: set[int] = set()

    def distinct(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) in seen:
            return leaf.clone()
        seen.add(id(leaf))
        return leaf

    return pytree.tree_map(distinct, (args, kwargs))


def _export(wrapper: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], model: torch.nn.Module,
            batch: Any, *, own_call: bool = False) -> ExportedProgram:
    """``torch.export.export(wrapper, args, kwargs, strict=False)`` with static shapes.

    Export failures the user can act on are raised as :class:`CaptureError` (the torch error is its
    ``__cause__``); other errors propagate unchanged. A program that exported with a data-dependent shape
    (torchpar compiles static shapes) raises :class:`CaptureError` too. ``own_call``: a ``step_fn`` /
    ``forward_fn`` calls the model, so a bad call of ``forward`` is that function's, not the calling convention's
    (the ``TypeError`` says so instead of explaining how torchpar unpacks the batch).
    """
    try:
        exported = torch.export.export(wrapper, args, kwargs, strict=False)
    except CaptureError:  # raised by torchpar's own capture code (a custom autograd.Function), already explained
        raise
    except Exception as e:
        forward_name = getattr(getattr(model, "forward", None), "__qualname__", None)
        if own_call and isinstance(e, TypeError) and forward_name and str(e).startswith(f"{forward_name}()"):
            raise TypeError(f"{e} (a step_fn / forward_fn calls the model itself: torchpar passes it (model, batch) "
                            "with the batch as it is, unpacked by nothing)") from e
        translated = translate_export_error(e, model, batch=batch)
        if translated is None:
            raise
        raise translated from e
    dynamic = dynamic_shape_error(exported, model)
    if dynamic is not None:
        raise dynamic
    return exported


def _leaf_paths(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    paths, _ = pytree.tree_flatten_with_path((args, kwargs))
    return [pytree.keystr(path[1:]) for path, _ in paths]


def _to_ir(exported: ExportedProgram, model: torch.nn.Module, *, user_output_kind: str) -> Graph:
    """Translate the exported program's graph and signature into the IR."""
    signature = exported.graph_signature
    canonical = _canonical_param_names(model)
    inputs: list[Input] = []
    constants: dict[str, np.ndarray] = {}
    user_index = 0
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, signature.input_specs, strict=True):
        meta = _meta_of(node.meta.get("val"))
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
    metas = {i.name: i.meta for i in inputs}
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
    for value, spec in zip(results, signature.output_specs, strict=True):
        ref = Ref(value.name) if isinstance(value, torch.fx.Node) else None
        if spec.kind == OutputKind.BUFFER_MUTATION:
            outputs.append(Output("buffer", ref, _strip_wrapper(spec.target)))
        elif spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(Output(user_output_kind, ref))
        else:
            raise NotImplementedError(
                f"torch.export output kind {spec.kind.name} ({spec.target}) is not supported: the model "
                "mutates one of its inputs in place; clone the input before mutating it")
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


def _target_name(target: Any) -> str:
    if target is BOUNDARY_TARGET:
        return "torchpar.pipeline_boundary"
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace == "torchpar":  # torchpar's own markers: torchpar.<name> (one overload each)
            return f"torchpar.{target._opname}"
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else str(target)
    if getattr(target, "__name__", None) == "getitem":
        return "getitem"
    return str(target)


def _convert(value: Any) -> Any:
    """fx argument → IR argument (see :mod:`torchpar.ir.graph`)."""
    if isinstance(value, torch.fx.Node):
        return Ref(value.name)
    if isinstance(value, torch.dtype):
        return DType(dtype_name(value))
    if isinstance(value, (torch.device, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_convert(v) for v in value) if isinstance(value, list) else tuple(_convert(v) for v in value)
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


def _tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(s) for s in tensor.shape), dtype_name(tensor.dtype))


def _meta_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _tensor_meta(value)
    if isinstance(value, (list, tuple)):
        return tuple(_tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in value)
    return None


def _source_line(stack_trace: str | None) -> str:
    """The innermost frame of the user's (or the model library's) code, not torch's own."""
    if not stack_trace:
        return ""
    lines = stack_trace.strip().splitlines()
    frames = [(lines[i].strip(), lines[i + 1].strip() if i + 1 < len(lines) else "")
              for i in range(len(lines)) if lines[i].lstrip().startswith("File ")]
    user_frames = [f for f in frames if "/torch/" not in f[0] and "torchpar/capture" not in f[0]
                   and "torchpar/__init__.py" not in f[0]]
    frame, code = (user_frames or frames or [("", "")])[-1]
    location = frame.removeprefix("File ").replace('", line ', ":").replace('"', "")
    return f"{location}: {code}" if code else location


def _module_path(stack: dict[str, tuple[str, Any]] | None) -> str:
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.removeprefix("model.").removeprefix("model")
