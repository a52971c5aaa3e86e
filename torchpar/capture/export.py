"""torch.export capture: ``nn.Module`` + example batch → :class:`torchpar.ir.Graph`.

The model is wrapped so that the exported program computes exactly what the user's loop computes: ``model(**batch)``
/ ``model(*batch)`` / ``model(batch)``, then the loss selected as ``docs/user_guide.md`` ("Compile and train",
``loss_fn``) states; or, given a ``step_fn(model, batch) -> loss`` (``forward_fn(model, batch) -> outputs`` for the
eval forward), that function, which calls the model its own way; a ``step_fn`` may return ``(loss, aux)``, ``aux`` a
``dict[str, torch.Tensor]`` of values to report (graph outputs of kind ``"aux"``, not differentiated). Export is
non-strict, then ``run_decompositions()`` reduces the graph to core ATen, except ``scaled_dot_product_attention``,
which stays one op (a fused lowering, one node for the planner); a mask it receives that is the same for every batch
(causal or all True) becomes its ``is_causal`` flag (:mod:`torchpar.capture.semantics.attention_masks`).

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
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from torchpar.capture.decompositions import decompose
from torchpar.capture.errors import CaptureError, dynamic_shape_error, parameter_write_error, translate_export_error
from torchpar.capture.meta_models import as_fake_cpu, on_meta_device
from torchpar.capture.module_state import (
    OUTSIDE_PREFIX,
    CapturedState,
    NumberAttribute,
    numbers_as_tensors,
    outside_modules,
    recording,
    tensors_as_buffers,
    watched_modules,
)
from torchpar.capture.precision import autocast_device, check_no_float64
from torchpar.capture.repeated_blocks import CAPTURED_BLOCKS, expand_blocks, find_block_stack, truncated
from torchpar.capture.semantics.attention_masks import fold_static_attention_masks
from torchpar.capture.semantics.autograd_functions import capture_autograd_functions
from torchpar.capture.semantics.batch_norm import cumulative_batch_norms
from torchpar.capture.semantics.distributions import unvalidated_distributions
from torchpar.capture.semantics.grad_semantics import (
    autograd_capture_guards,
    check_gradient_hooks,
    mark_stop_gradients,
    module_modes,
    restore_module_modes,
)
from torchpar.capture.semantics.inner_gradients import refusing_inner_gradients
from torchpar.capture.semantics.remat import reentrant_checkpoints_inline
from torchpar.capture.to_ir import tensor_meta, to_ir
from torchpar.ir.graph import Graph, TensorMeta

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]
StepFn = Callable[[torch.nn.Module, Any], object]
"""``step_fn(model, batch) -> loss | (loss, aux)``: calls the model as it likes (``compile(step_fn=...)``); ``loss`` a
scalar tensor, ``aux`` a ``dict[str, torch.Tensor]`` the step returns beside the loss."""
ForwardFn = Callable[[torch.nn.Module, Any], object]
"""``forward_fn(model, batch) -> outputs``: the eval forward's call of the model (``compile(forward_fn=...)``)."""


@dataclasses.dataclass
class Capture:
    """An exported model step.

    ``graph`` is the IR. ``in_spec`` is the pytree spec of ``(args, kwargs)`` the model was called
    with; user inputs of the graph are its leaves in order, with metas ``input_metas``.
    ``out_spec`` unflattens the graph's user outputs (eval capture). ``export_s`` and
    ``decompose_s`` are the seconds spent in ``torch.export`` and ``run_decompositions``. ``state``: the module
    state the step reads beside the model's parameters and buffers (:mod:`torchpar.capture.module_state`).
    ``aux_keys``: the keys of the ``aux`` dict a ``step_fn`` returned beside the loss, in its order (the graph's
    ``"aux"`` outputs), or ``None`` where the step returned the loss alone.
    """

    graph: Graph
    in_spec: pytree.TreeSpec
    input_metas: list[TensorMeta]
    out_spec: pytree.TreeSpec | None
    export_s: float
    decompose_s: float
    state: CapturedState = dataclasses.field(default_factory=CapturedState)
    aux_keys: tuple[str, ...] | None = None


def batch_to_call_args(batch: object) -> tuple[tuple[object, ...], dict[str, object]]:
    """The calling convention: dict → ``model(**batch)``, tuple/list → ``model(*batch)``, else
    ``model(batch)``."""
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def call_args_to_batch(batch_type: type, args: tuple[Any, ...], kwargs: dict[str, object]) -> object:
    """Inverse of :func:`batch_to_call_args`, for handing the batch to a ``loss_fn``."""
    if issubclass(batch_type, dict):
        return kwargs
    if issubclass(batch_type, tuple) and hasattr(batch_type, "_fields"):  # a namedtuple
        return batch_type(*args)
    if issubclass(batch_type, (tuple, list)):
        return batch_type(args)
    return args[0]


def select_loss(outputs: Any, batch: object, loss_fn: LossFn | None) -> torch.Tensor:
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
            "loss_fn=lambda outputs, batch: ... to torchpar.compile"
        )
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        if loss_fn is None and isinstance(outputs, torch.Tensor):  # not a loss: e.g. a classifier's logits
            raise ValueError(
                f"the model returned a tensor of shape {list(shape)}, not a scalar loss: compile with a step_fn that "
                "calls the model and returns the loss, e.g. step_fn=lambda model, batch: "
                "torch.nn.functional.cross_entropy(model(batch[0]), batch[1]) for a batch (inputs, targets), or "
                "loss_fn=lambda outputs, batch: ... for a loss of the model's outputs"
            )
        raise ValueError(f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) in loss_fn")
    return loss


def check_model_fns(loss_fn: LossFn | None, step_fn: StepFn | None, forward_fn: ForwardFn | None) -> None:
    """``step_fn`` / ``forward_fn`` take exactly ``(model, batch)``; ``step_fn`` excludes ``loss_fn``."""
    if step_fn is not None and loss_fn is not None:
        raise ValueError(
            "pass step_fn or loss_fn, not both: step_fn(model, batch) calls the model and returns the "
            "loss itself (fold the loss_fn into it)"
        )
    for name, fn in (("step_fn", step_fn), ("forward_fn", forward_fn)):
        if fn is not None:
            check_model_fn(fn, name)


def check_model_fn(fn: object, name: str) -> None:
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
        raise TypeError(
            f"{name} must take exactly two positional arguments (model, batch); "
            f"{getattr(fn, '__name__', name)}{signature} cannot be called so ({error}). "
            f"Write it as def {name}(model, batch): ..."
        ) from None


def _scalar_loss(loss: object, name: str) -> torch.Tensor:
    """``loss`` if it is a scalar tensor, else an error saying what ``name`` returned instead."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{name} must return the loss as a scalar torch.Tensor, got a {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(
            f"{name} must return a scalar loss, got a tensor of shape {list(loss.shape)}; reduce it "
            "(e.g. .mean(), or F.cross_entropy's default reduction='mean')"
        )
    return loss


def split_step_result(result: object) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """``(loss, aux)`` of what a ``step_fn`` returned: a scalar loss (``aux`` ``None``), or a pair ``(loss, aux)``
    with ``aux`` a dict of tensors keyed by strings. Anything else is a ``TypeError`` / ``ValueError`` naming what was
    returned."""
    if not isinstance(result, (tuple, list)):
        return _scalar_loss(result, "step_fn"), None
    if len(result) != 2 or not isinstance(result[1], dict):
        raise TypeError(
            f"step_fn must return the loss or a pair (loss, aux) with aux a dict of tensors, got a "
            f"{type(result).__name__} of {_describe(result)}"
        )
    loss, aux = result
    loss = _scalar_loss(loss, "step_fn")
    for key, value in aux.items():
        if not isinstance(key, str):
            raise TypeError(f"step_fn's aux dict must be keyed by strings, got the key {key!r} ({type(key).__name__})")
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"step_fn's aux[{key!r}] must be a torch.Tensor, got a {type(value).__name__} "
                f"({_describe([value])}); return tensors only (torch.stack a list, torch.tensor a number)"
            )
    return loss, dict(aux)


def _describe(values: Iterable[object]) -> str:
    """``"(Tensor[], dict, int)"``: the types of ``values``, a tensor with its shape, for error messages."""

    def one(value: object) -> str:
        return f"Tensor{list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__

    return "(" + ", ".join(one(v) for v in values) + ")"


class _StepFnModule(torch.nn.Module):
    """Calls ``step_fn(model, batch)`` and returns its scalar loss, or ``(loss, aux)`` (the exported training step of
    ``compile(step_fn=...)``; :func:`split_step_result` checks what it returned, and the exported program's output
    spec keeps the aux dict's keys: :func:`_aux_keys`). The model is the child ``model``, so its parameters keep their
    names once the ``model.`` prefix is stripped, as with :class:`_LossModule`."""

    def __init__(self, model: torch.nn.Module, batch_type: type, step_fn: StepFn):
        super().__init__()
        self.model = model
        self._batch_type = batch_type
        self._step_fn = step_fn

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, aux = split_step_result(self._step_fn(self.model, call_args_to_batch(self._batch_type, args, kwargs)))
        return loss if aux is None else (loss, aux)


def _aux_keys(out_spec: pytree.TreeSpec) -> tuple[str, ...] | None:
    """The keys of the aux dict in a training step's output spec ``(loss, aux)`` (its flattened outputs: the loss,
    then the aux values in this order), ``None`` for a loss alone."""
    if out_spec.type is not tuple:
        return None
    return tuple(out_spec.child(1).context)


class _ForwardFnModule(torch.nn.Module):
    """Calls ``forward_fn(model, batch)`` and returns what it returns (the eval forward of
    ``compile(forward_fn=...)``)."""

    def __init__(self, model: torch.nn.Module, batch_type: type, forward_fn: ForwardFn):
        super().__init__()
        self.model = model
        self._batch_type = batch_type
        self._forward_fn = forward_fn

    def forward(self, *args: object, **kwargs: object) -> object:
        return self._forward_fn(self.model, call_args_to_batch(self._batch_type, args, kwargs))


class _LossModule(torch.nn.Module):
    """Calls the user's model and returns the scalar loss (the exported training step)."""

    def __init__(self, model: torch.nn.Module, batch_type: type, loss_fn: LossFn | None):
        super().__init__()
        self.model = model
        self._batch_type = batch_type
        self._loss_fn = loss_fn

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        outputs = self.model(*args, **kwargs)
        return select_loss(outputs, call_args_to_batch(self._batch_type, args, kwargs), self._loss_fn)


class _ForwardModule(torch.nn.Module):
    """Calls the user's model and returns its outputs unchanged (the exported eval forward)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.model(*args, **kwargs)


def capture_train_step(
    model: torch.nn.Module,
    batch: object,
    loss_fn: LossFn | None = None,
    *,
    autocast: torch.dtype | None = None,
    step_fn: StepFn | None = None,
    outside: tuple[torch.nn.Module, ...] = (),
    numbers: tuple[NumberAttribute, ...] = (),
) -> Capture:
    """Export ``model`` in train mode on ``batch`` into a graph whose first output is the loss (plus the new values of
    mutated buffers). ``step_fn``: the loss is ``step_fn(model, batch)`` instead of the calling convention and
    ``loss_fn`` (not both); a ``(loss, aux)`` it returns adds one output of kind ``"aux"`` per aux entry, after the
    loss (``Capture.aux_keys``).

    ``autocast``: export under ``torch.autocast(device, autocast)``, ``device`` the type of the device the model
    lives on (:func:`torchpar.capture.precision.autocast_device`), so PyTorch's own casting policy (which ops
    run in the low dtype, which stay float32) is in the graph as explicit casts; the parameters stay in their
    dtype (the float32 master weights of mixed precision), and the backward ``jax.grad`` derives casts their
    gradients back.

    ``outside``: modules outside ``model`` the step is known to call (a previous capture's ``state.outside``); their
    state is named ``outside<i>.<name>`` in that order, and any further one found is appended. ``numbers``: float
    attributes captured as step inputs (:func:`~torchpar.capture.module_state.numbers_as_tensors`)."""
    check_no_float64(model)
    if step_fn is not None:
        if loss_fn is not None:
            raise ValueError("pass step_fn or loss_fn, not both: step_fn(model, batch) returns the loss itself")
        wrapper: torch.nn.Module = _StepFnModule(model, type(batch), step_fn)
    else:
        wrapper = _LossModule(model, type(batch), loss_fn)
    return _capture(
        wrapper,
        model,
        batch,
        training=True,
        autocast=autocast,
        own_call=step_fn is not None,
        outside=outside,
        numbers=numbers,
    )


def capture_forward(
    model: torch.nn.Module,
    batch: object,
    *,
    autocast: torch.dtype | None = None,
    forward_fn: ForwardFn | None = None,
    outside: tuple[torch.nn.Module, ...] = (),
    numbers: tuple[NumberAttribute, ...] = (),
) -> Capture:
    """Export ``model`` in eval mode on ``batch``; the graph's outputs are the model's outputs (``forward_fn``:
    ``forward_fn(model, batch)``'s). ``autocast``, ``outside`` and ``numbers`` as in :func:`capture_train_step`.

    HuggingFace models are exported with ``config.use_cache = False``: a KV cache object is not a tensor
    output (and training-style evaluation does not need it)."""
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        assert config is not None  # use_cache was read from it
        config.use_cache = False
    try:
        wrapper = _ForwardModule(model) if forward_fn is None else _ForwardFnModule(model, type(batch), forward_fn)
        return _capture(
            wrapper,
            model,
            batch,
            training=False,
            autocast=autocast,
            own_call=forward_fn is not None,
            outside=outside,
            numbers=numbers,
        )
    finally:
        if use_cache:
            assert config is not None  # use_cache was read from it
            config.use_cache = use_cache


def _capture(
    wrapper: torch.nn.Module,
    model: torch.nn.Module,
    batch: object,
    *,
    training: bool,
    autocast: torch.dtype | None = None,
    own_call: bool = False,
    outside: tuple[torch.nn.Module, ...] = (),
    numbers: tuple[NumberAttribute, ...] = (),
) -> Capture:
    """The capture of ``wrapper`` (which calls ``model``) on ``batch``: for a meta model with a deep stack of
    identical blocks, traced on three blocks and repeated (:mod:`.repeated_blocks`), else traced whole."""
    stack = find_block_stack(model) if on_meta_device(model) else None
    if stack is not None:
        try:
            with truncated(model, stack):
                short = _capture_whole(
                    wrapper,
                    model,
                    batch,
                    training=training,
                    autocast=autocast,
                    own_call=own_call,
                    outside=outside,
                    numbers=numbers,
                )
        except Exception as error:  # e.g. a forward that indexes the blocks by config.num_hidden_layers
            log.info(
                "capturing %d of the %d blocks of %s failed (%s: %s); capturing them all",
                CAPTURED_BLOCKS,
                stack.count,
                stack.path,
                type(error).__name__,
                error,
            )
        else:
            graph = expand_blocks(short.graph, stack)
            if graph is not None:
                log.info(
                    "captured %d of the %d identical blocks of %s and repeated them: %d ops",
                    CAPTURED_BLOCKS,
                    stack.count,
                    stack.path,
                    len(graph.nodes),
                )
                return dataclasses.replace(short, graph=graph)
            log.info(
                "the blocks of %s are not one repeatable program in the trace; capturing all %d",
                stack.path,
                stack.count,
            )
    return _capture_whole(
        wrapper, model, batch, training=training, autocast=autocast, own_call=own_call, outside=outside, numbers=numbers
    )


def _capture_whole(
    wrapper: torch.nn.Module,
    model: torch.nn.Module,
    batch: object,
    *,
    training: bool,
    autocast: torch.dtype | None = None,
    own_call: bool = False,
    outside: tuple[torch.nn.Module, ...] = (),
    numbers: tuple[NumberAttribute, ...] = (),
) -> Capture:
    """One export of ``wrapper`` with the module state watched (:mod:`.module_state`); when the step calls modules
    outside the model that ``outside`` does not hold yet, it is captured again with them registered beside the model
    (``outside<i>``), so their parameters and buffers are the step's inputs rather than constants."""
    for i, module in enumerate(outside):
        wrapper.add_module(f"{OUTSIDE_PREFIX}{i}", module)
    modules = watched_modules(model, outside)
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
        casting = (
            torch.autocast(autocast_device(model, leaves), autocast)
            if autocast is not None
            else contextlib.nullcontext()
        )
        # a meta model has no autocast dispatch: under autocast it is captured as fake CPU tensors (meta_models)
        fake_cpu = (
            as_fake_cpu(model, args, kwargs)
            if autocast is not None and on_meta_device(model)
            else contextlib.nullcontext((args, kwargs))
        )
        with casting, fake_cpu as (args, kwargs):
            t0 = time.perf_counter()
            with (
                torch.no_grad() if not training else contextlib.nullcontext(),
                autograd_capture_guards(),
                capture_autograd_functions(enabled=training) as functions,
                numbers_as_tensors(numbers) as fed,
                tensors_as_buffers(modules) as attributes,
                recording(wrapper, modules) as access,
                cumulative_batch_norms(wrapper) if training else contextlib.nullcontext(),
                reentrant_checkpoints_inline(),
                refusing_inner_gradients(model),
                unvalidated_distributions(),
            ):
                exported = _export(wrapper, args, kwargs, model, batch, own_call=own_call)
            found = outside_modules(access.called, wrapper)
            if not found:
                if training:
                    stops = mark_stop_gradients(exported)
                    if stops:
                        log.info("%d stop-gradient(s) (detach, no_grad regions) kept in the training graph", stops)
                t1 = time.perf_counter()
                exported = decompose(exported)
                t2 = time.perf_counter()
    finally:
        restore_module_modes(model, modes)
    if found:
        log.info(
            "the step calls %s outside the model: capturing it again with their state as inputs",
            ", ".join(type(m).__name__ for m in found),
        )
        return _capture_whole(
            wrapper,
            model,
            batch,
            training=training,
            autocast=autocast,
            own_call=own_call,
            outside=(*outside, *found),
            numbers=numbers,
        )
    folded = fold_static_attention_masks(exported.graph)
    if folded:
        log.info("%d attention call(s) take a constant causal / full mask: folded into is_causal", folded)
    aux_keys = _aux_keys(exported.call_spec.out_spec) if training else None
    graph = to_ir(exported, model, user_output_kind="loss" if training else "user", aux_keys=aux_keys or ())
    if functions.calls:  # custom autograd.Function backwards, each its own graph
        graph = graph.replace(custom_backwards=functions.backward_graphs(model))
        graph.validate()
    log.info(
        "captured %s graph: %d ops (export %.2fs, decompose %.2fs)",
        "train" if training else "eval",
        len(graph.nodes),
        t1 - t0,
        t2 - t1,
    )
    return Capture(
        graph=graph,
        in_spec=in_spec,
        input_metas=[tensor_meta(leaf) for leaf in leaves],
        out_spec=None if training else exported.call_spec.out_spec,
        export_s=t1 - t0,
        decompose_s=t2 - t1,
        state=CapturedState(
            reads=tuple(access.reads.values()),
            tensor_attributes=tuple(a for a in attributes if (id(a[1]), a[2]) not in fed),
            numbers=tuple(a for a in attributes if (id(a[1]), a[2]) in fed),
            outside=outside,
            copied_buffers=tuple(access.copied_buffers),
        ),
        aux_keys=aux_keys,
    )


def _unaliased(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[tuple[object, ...], dict[str, object]]:
    """The call arguments with every repeated tensor object (``{"input_ids": ids, "labels": ids}``) cloned:
    torch.export would make one graph input of both, and a later batch whose two entries differ would feed
    one of them to both uses."""
    seen: set[int] = set()

    def distinct(leaf: object) -> object:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) in seen:
            return leaf.clone()
        seen.add(id(leaf))
        return leaf

    return pytree.tree_map(distinct, (args, kwargs))


def _export(
    wrapper: torch.nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    model: torch.nn.Module,
    batch: object,
    *,
    own_call: bool = False,
) -> ExportedProgram:
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
            raise TypeError(
                f"{e} (a step_fn / forward_fn calls the model itself: torchpar passes it (model, batch) "
                "with the batch as it is, unpacked by nothing)"
            ) from e
        translated = translate_export_error(e, model, batch=batch)
        if translated is None:
            raise
        # the torch error stays the cause (its type and text), without the ~150 frames of torch.export under it
        # that bury the explanation; those are logged at DEBUG
        log.debug("torch.export failed (translated into the CaptureError that follows):", exc_info=e)
        raise translated from e.with_traceback(None)
    for error in (dynamic_shape_error(exported, model), parameter_write_error(exported, model)):
        if error is not None:
            raise error
    return exported


def _leaf_paths(args: tuple[object, ...], kwargs: dict[str, object]) -> list[str]:
    paths, _ = pytree.tree_flatten_with_path((args, kwargs))
    return [pytree.keystr(path[1:]) for path, _ in paths]
