"""torch.export failures → errors that say what to do.

:func:`translate_export_error` turns the failures a user can act on (Python control flow on tensor values,
data-dependent shapes, constructs export cannot trace, a batch that does not fit ``forward``'s signature)
into a :class:`CaptureError` naming the model's source line, why export cannot trace it, and the fix.
:func:`dynamic_shape_error` finds data-dependent shapes in a program that exported fine (export records
them as unbacked sizes; torchpar, which compiles static shapes with XLA, cannot). :func:`describe_batch_mismatch`
says in words how a batch differs in structure from the example batch.
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import os
import re
import sysconfig
import traceback
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._dynamo.exc import TorchDynamoException
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import (
    GuardOnDataDependentSymNode,
    PendingUnbackedSymbolNotFound,
    free_unbacked_symbols,
)


class CaptureError(RuntimeError):
    """A model step torch.export cannot trace.

    The message names the model's source line (file:line and the code), why export cannot trace it, and
    the fix. When it translates a torch error, that error is its ``__cause__``.
    """


@dataclasses.dataclass(frozen=True)
class SourceLine:
    """One line of the user's code: ``filename:lineno in function`` and the code text."""

    filename: str
    lineno: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"  at {self.filename}:{self.lineno} in {self.function}\n      {self.code}"


# Error kinds, in the order they are tested.
_DYNAMIC_SHAPE = "dynamic shape"
_CONTROL_FLOW = "control flow"
_OUTPUT_TYPE = "output type"
_UNSUPPORTED = "unsupported"

# Text of plain RuntimeErrors that fake tensors (export traces with them) raise for untraceable code.
_FAKE_TENSOR_MARKERS = ("tensor subclasses", "FakeTensor", "fake tensor", "data pointer", "cannot be traced")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CAPTURE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIRS = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib")})
_TEXT_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)\n(?P<code>[^\n]*)')
_MAX_NAMES = 8


# ---------------------------------------------------------------------------------------------------------------
# translate_export_error


def translate_export_error(
    error: BaseException, model: torch.nn.Module, *, batch: object = None
) -> CaptureError | None:
    """A :class:`CaptureError` explaining ``error`` (raised by ``torch.export.export`` on ``model``), or ``None``
    when ``error`` is not an export problem and must propagate unchanged.

    ``batch`` (optional) is the batch the model was called with; it makes a call-signature error name the
    batch's keys or entries. The caller chains the original: ``raise translated from error``.
    """
    signature_error = _call_signature_error(error, model, batch)
    if signature_error is not None:
        return signature_error
    for cause in _chain(error):
        kind = _error_kind(cause)
        if kind is not None:
            source = _source_line(error) or _source_line(cause)
            return CaptureError(_export_message(kind, cause, model, source))
    return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and its explicit causes (``raise ... from``), outermost first."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__


def _error_kind(error: BaseException) -> str | None:
    """Which export failure ``error`` is (one of the ``_*`` kinds above), ``None`` if none."""
    text = str(error)
    if (
        isinstance(error, (DynamicOutputShapeException, PendingUnbackedSymbolNotFound))
        or "extract specialized integer" in text
    ):
        return _DYNAMIC_SHAPE
    if isinstance(error, (GuardOnDataDependentSymNode, DataDependentOutputException)) or re.search(
        r"data[- ]dependent", text, re.IGNORECASE
    ):
        return _CONTROL_FLOW
    if "register a pytree" in text or "not a known type" in text:
        return _OUTPUT_TYPE
    if isinstance(error, (TorchDynamoException, UnsupportedOperatorException, UnsupportedFakeTensorException)) or any(
        marker in text for marker in _FAKE_TENSOR_MARKERS
    ):
        return _UNSUPPORTED
    return None


def _export_message(kind: str, error: BaseException, model: torch.nn.Module, source: SourceLine | None) -> str:
    """The full message: headline, the source line, why, and the fix."""
    name = type(model).__name__
    where = str(source) if source is not None else "  (no line of the model's code is on the stack)"
    reason = _first_lines(str(error), count=1).split(" (unhinted:")[0]
    if isinstance(error, DataDependentOutputException):
        reason = f"{reason} returns a Python value computed from tensor values"
    if kind == _OUTPUT_TYPE:
        reason = reason.split(". ")[0]
    if kind == _CONTROL_FLOW:
        return (
            f"torch.export cannot trace {name}: Python control flow in forward depends on a tensor's value\n"
            f"{where}\n"
            "Why: export traces forward once into one graph that serves every batch; while tracing, tensors have "
            "shapes but no values, so a Python if/while/for, bool() or .item() on a tensor value cannot choose a "
            f"branch (torch: {reason}).\n"
            "Fix: compute both sides and select with torch.where(cond, a, b); or trace both branches with "
            "torch.cond(pred, true_fn, false_fn, operands); if the condition only checks a size assumption, "
            "state it with torch._check(...); or move the branch out of forward (decide it in the training "
            "loop and pass the result in the batch)."
        )
    if kind == _DYNAMIC_SHAPE:
        return (
            f"torch.export cannot trace {name}: a tensor's shape (or a Python int) depends on tensor values\n"
            f"{where}\n"
            "Why: boolean-mask indexing x[mask], nonzero, unique, masked_select and int(tensor) give sizes that "
            "are only known once the values are; torchpar compiles the step with XLA, which fixes every shape "
            f"at compile time (torch: {reason}).\n"
            f"Fix: {_STATIC_SHAPE_FIX}"
        )
    if kind == _OUTPUT_TYPE:
        return (
            f"torch.export cannot trace {name}: forward returns an object export does not know how to flatten\n"
            f"{where}\n"
            f"Why: export needs the outputs as tensors in tuples, lists, dicts or dataclasses (torch: {reason}).\n"
            "Fix: return tensors (or a tuple/dict of tensors), or register the output class with "
            "torch.utils._pytree.register_pytree_node."
        )
    return (
        f"torch.export cannot trace {name}\n"
        f"{where}\n"
        f"Why (torch): {_first_lines(str(error))}\n"
        "Fix: rewrite this line with tensor operations export can trace (no conversion of tensors to Python or "
        "NumPy values, no unsupported Python objects or calls); the original torch error, chained below, has "
        "the details."
    )


_STATIC_SHAPE_FIX = (
    "keep shapes static: replace x[mask].sum() by torch.where(mask, x, 0).sum() (or x * mask); use "
    "torch.nonzero_static(x, size=k) or masks and counts instead of nonzero/unique; if the size is in fact "
    "fixed, state it with torch._check(n == size) so export can use it."
)


def _first_lines(text: str, count: int = 3, width: int = 300) -> str:
    """The first ``count`` non-empty lines of ``text``, stripped, each cut at ``width`` characters, joined."""
    lines = [line.strip() for line in text.splitlines() if line.strip()][:count]
    return " / ".join(line if len(line) <= width else line[:width] + "…" for line in lines)


# ---------------------------------------------------------------------------------------------------------------
# the user's source line


def _is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's (or a model library's) code: not torch, torchpar.capture, the
    standard library or generated code (``<string>``, ``<eval_with_key>``)."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith((_TORCH_DIR, _CAPTURE_DIR)):
        return False
    installed = f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
    return installed or not path.startswith(_STDLIB_DIRS)


def _source_line(error: BaseException) -> SourceLine | None:
    """The innermost user frame in which ``error`` was raised: from the traceback, below the last frame of
    torchpar.capture (above it are the caller's frames), else from a ``File "...", line N`` in its text."""
    frames = traceback.extract_tb(error.__traceback__)
    below = [i for i, f in enumerate(frames) if os.path.abspath(f.filename).startswith(_CAPTURE_DIR)]
    for frame in reversed(frames[below[-1] + 1 :] if below else frames):
        if _is_user_file(frame.filename) and frame.lineno is not None:
            return SourceLine(frame.filename, frame.lineno, frame.name, (frame.line or "").strip())
    return _source_line_in_text(str(error))


def _source_line_in_text(text: str) -> SourceLine | None:
    """The innermost user frame among the ``File "...", line N, in f`` frames quoted in ``text``."""
    for match in reversed(list(_TEXT_FRAME.finditer(text))):
        filename, lineno = match["file"], int(match["line"])
        if _is_user_file(filename):
            code = match["code"].strip() or linecache.getline(filename, lineno).strip()
            return SourceLine(filename, lineno, match["fn"].strip(), code)
    return None


# ---------------------------------------------------------------------------------------------------------------
# dynamic_shape_error


def dynamic_shape_error(exported: ExportedProgram, model: torch.nn.Module) -> CaptureError | None:
    """A :class:`CaptureError` naming the first op of ``exported`` whose output shape depends on tensor
    values (an unbacked size), with its source line; ``None`` if every shape is static."""
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        value = node.meta.get("val")
        tensors = [v for v in (value if isinstance(value, (tuple, list)) else [value]) if isinstance(v, torch.Tensor)]
        dynamic = next((t for t in tensors if free_unbacked_symbols(t.shape)), None)
        if dynamic is None:
            continue
        source = _source_line_in_text(node.meta.get("stack_trace") or "")
        where = str(source) if source is not None else f"  (op {node.name}; its source line is unknown)"
        shape = "(" + ", ".join(str(s) for s in dynamic.shape) + ("," if dynamic.dim() == 1 else "") + ")"
        return CaptureError(
            f"torch.export cannot trace {type(model).__name__} for torchpar: the shape of a tensor depends on "
            "tensor values\n"
            f"{where}\n"
            f"Why: {_op_name(node.target)} returns a tensor of shape {shape}, where {_symbols(dynamic)} is only "
            "known once the values are (boolean-mask indexing x[mask], nonzero, unique, masked_select, "
            "repeat_interleave with tensor repeats); torchpar compiles the step with XLA, which fixes every shape "
            "at compile time.\n"
            f"Fix: {_STATIC_SHAPE_FIX}"
        )
    return None


_ALIASING = frozenset(
    {
        "detach",
        "alias",
        "view",
        "_unsafe_view",
        "t",
        "transpose",
        "permute",
        "select",
        "slice",
        "expand",
        "as_strided",
        "unsqueeze",
        "squeeze",
        "reshape",
        "flatten",
        "unflatten",
        "diagonal",
        "narrow",
        "split",
        "chunk",
        "unbind",
    }
)
"""ATen ops whose result may share a tensor's storage: writing into it writes the parameter."""


def parameter_write_error(exported: ExportedProgram, model: torch.nn.Module) -> CaptureError | None:
    """A :class:`CaptureError` naming the first op of ``exported`` that writes into a parameter through an alias
    (``nn.Embedding(max_norm=...)``'s ``embedding_renorm_`` on ``weight.detach()``, a ``p.data.clamp_()`` in
    ``forward``), with its source line; ``None`` if no parameter is written. torch.export keeps such a write out of
    the program's outputs, so the compiled step would silently skip it."""
    aliases = dict(exported.graph_signature.inputs_to_parameters)
    for node in exported.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        sources = [a for a in node.args if isinstance(a, torch.fx.Node) and a.name in aliases]
        if node.target._opname in _ALIASING and sources:
            aliases[node.name] = aliases[sources[0].name]
            continue
        for argument, value in zip(schema.arguments, node.args):
            written = argument.alias_info is not None and argument.alias_info.is_write
            if written and isinstance(value, torch.fx.Node) and value.name in aliases:
                source = _source_line_in_text(node.meta.get("stack_trace") or "")
                where = str(source) if source is not None else f"  (op {node.name}; its source line is unknown)"
                name = aliases[value.name].removeprefix("model.")  # the capture wrapper's prefix
                return CaptureError(
                    f"{type(model).__name__}'s forward writes into the parameter {name!r} "
                    f"in place\n{where}\n"
                    f"Why: {_op_name(node.target)} changes the parameter's values inside forward (through "
                    f"{'itself' if value.name in exported.graph_signature.inputs_to_parameters else 'a detached alias'}"
                    "); torch.export leaves such writes out of the program, so torchpar would train without them "
                    "and silently differ from PyTorch.\n"
                    "Fix: do the write outside the step (e.g. renormalise the embedding between steps: "
                    "with torch.no_grad(): w.copy_(torch.renorm(w, 2, 0, max_norm)), then the engine reads the "
                    "model's new weights), or drop it (nn.Embedding without max_norm)."
                )
    return None


def _op_name(target: object) -> str:
    """``aten.nonzero.default`` for an ATen overload, else the target's name."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _symbols(tensor: torch.Tensor) -> str:
    """The unbacked size symbols of ``tensor``'s shape, as text (``u0``, ``u0 and u1``)."""
    names = sorted(str(s) for s in free_unbacked_symbols(tensor.shape))
    return " and ".join(names)


# ---------------------------------------------------------------------------------------------------------------
# forward called with arguments it does not take


def _call_signature_error(error: BaseException, model: torch.nn.Module, batch: object) -> CaptureError | None:
    """A :class:`CaptureError` if ``error`` is the TypeError of calling ``model.forward`` itself with the
    batch's arguments (missing / unexpected / too many); ``None`` for any other error, including TypeErrors
    raised inside forward."""
    forward = getattr(model, "forward", None)
    qualname = getattr(forward, "__qualname__", None)
    if not isinstance(error, TypeError) or qualname is None or not str(error).startswith(f"{qualname}()"):
        return None
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    if _raised_inside(error, code):
        return None
    assert forward is not None  # it has a __qualname__
    problem = str(error).removeprefix(f"{qualname}() ").strip()

    names = re.findall(r"'([^']+)'", problem)
    return CaptureError(
        f"{qualname}() {_describe_problem(problem, names)}: {_calling_convention(batch)}\n"
        f"  forward's signature: {_plain_signature(forward)}\n"
        f"Fix: {_signature_fix(problem, names, forward, batch)}"
    )


def _plain_signature(forward: Callable[..., object]) -> str:
    """``forward(input_ids, labels=None)``: the parameters without annotations; ``forward(...)`` if unknown."""
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        return "forward(...)"
    parameters = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    return f"forward{signature.replace(parameters=parameters, return_annotation=signature.empty)}"


def _raised_inside(error: BaseException, code: types.CodeType | None) -> bool:
    """Whether a frame of ``error``'s traceback runs ``code`` (the error was raised inside that function)."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def _describe_problem(problem: str, names: list[str]) -> str:
    """Python's TypeError text (``missing 1 required positional argument: 'labels'``) in plain words."""
    if problem.startswith("missing"):
        return f"is missing the required argument{'s' if len(names) > 1 else ''} {_quoted(names)}"
    if "unexpected keyword argument" in problem:
        return f"does not take the argument {_quoted(names)}"
    if "multiple values" in problem:
        return f"got two values for the argument {_quoted(names)} (a batch entry and a batch key)"
    return problem


def _calling_convention(batch: object) -> str:
    """How torchpar calls the model with ``batch``, and what the batch holds."""
    if isinstance(batch, Mapping):
        return f"the batch keys are passed as model(**batch), and this batch has the keys {_quoted(list(batch))}"
    if isinstance(batch, (tuple, list)):
        return f"the batch entries are passed positionally as model(*batch), and this batch has {_entries(len(batch))}"
    if batch is not None:
        return "the batch is passed as model(batch)"
    return "the batch keys are passed as model(**batch) (a tuple or list batch as model(*batch))"


def _signature_fix(problem: str, names: list[str], forward: Callable[..., object], batch: object) -> str:
    """What to change in the batch or in forward so that the call fits."""
    missing, extra = _signature_mismatch(forward, batch)
    if problem.startswith("missing"):
        missing = missing or names
    elif "unexpected keyword argument" in problem:
        extra = extra or names
    if len(missing) == 1 and len(extra) == 1:
        return f"rename the batch key {_quoted(extra)} to {_quoted(missing)}, or rename forward's parameter."
    fixes = []
    if missing:
        fixes.append(
            f"add {_quoted(missing)} to the batch, or give {'them' if len(missing) > 1 else 'it'} a "
            f"default in forward (e.g. {missing[0]}=None)"
        )
    if extra:
        fixes.append(
            f"remove {_quoted(extra)} from the batch, or accept {'them' if len(extra) > 1 else 'it'} in "
            "forward (as a parameter or **kwargs)"
        )
    if not fixes and "were given" in problem and isinstance(batch, (tuple, list)):
        # forward takes fewer entries than the batch holds: most often (inputs, targets) for a model returning logits
        return (
            "if the batch's last entries are targets, compute the loss in a step_fn, e.g. torchpar.compile(model, "
            "optimizer, example_batch=batch, step_fn=lambda model, batch: "
            "torch.nn.functional.cross_entropy(model(*batch[:-1]), batch[-1])); otherwise make the batch's "
            "entries match forward's parameters."
        )
    if not fixes:
        return "make the batch's entries match forward's parameters, in order for a tuple or list batch."
    return "; ".join(fixes) + "."


def _signature_mismatch(forward: Callable[..., object], batch: object) -> tuple[list[str], list[str]]:
    """For a dict batch: forward's required parameters the batch lacks, and the batch keys forward does not
    take; two empty lists when the batch is not a dict or the signature is unknown."""
    if not isinstance(batch, Mapping):
        return [], []
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return [], []
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters)
    missing = [p.name for p in named if p.default is p.empty and p.name not in batch]
    extra = [] if takes_any else [k for k in batch if k not in {p.name for p in named}]
    return missing, extra


# ---------------------------------------------------------------------------------------------------------------
# describe_batch_mismatch


def describe_batch_mismatch(expected: object, got: object) -> str:
    """One sentence saying how batch ``got`` differs from the example batch ``expected``: missing and extra
    keys (``renamed? 'x' → 'y'`` when exactly one is missing and one is new), a different number of entries,
    a different container type, a different tensor shape or dtype; nested entries are named by their path
    (``batch['a']['b']``). Never prints a TreeSpec."""
    differences = list(_differences("batch", expected, got))
    if not differences:
        return "this batch has the same structure, shapes and dtypes as the example batch."
    return "; ".join(differences) + "."


def _differences(path: str, expected: Any, got: Any) -> Iterator[str]:
    """The differences between ``expected`` and ``got`` at ``path``, in words, outermost first."""
    top = path == "batch"
    kind_e, kind_g = _kind_name(expected), _kind_name(got)
    if _category(expected) != _category(got) or (_category(expected) == "other" and kind_e != kind_g):
        if top:
            yield f"the example batch is {kind_e}, this one {kind_g}"
        else:
            yield f"{path} is {kind_e} in the example batch, {kind_g} in this one"
        return
    category = _category(expected)
    if category == "mapping":
        yield from _mapping_differences(path, expected, got)
    elif category == "sequence":
        if len(expected) != len(got):
            if top:
                yield f"the example batch has {_entries(len(expected))}, this one {len(got)}"
            else:
                yield f"{path} has {_entries(len(expected))} in the example batch, {len(got)} in this one"
            return
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            yield from _differences(f"{path}[{i}]", e, g)
    elif category == "tensor" and (tuple(expected.shape) != tuple(got.shape) or expected.dtype != got.dtype):
        if top:
            yield f"the example batch is {_tensor_text(expected)}, this one {_tensor_text(got)}"
        else:
            yield f"{path} is {_tensor_text(expected)} in the example batch, {_tensor_text(got)} in this one"


def _mapping_differences(path: str, expected: Mapping, got: Mapping) -> Iterator[str]:
    """Missing, extra and renamed keys of two mappings at ``path``, then the differences of common keys."""
    missing = [k for k in expected if k not in got]
    extra = [k for k in got if k not in expected]
    owner = "this batch" if path == "batch" else f"{path} in this batch"
    if len(missing) == 1 and len(extra) == 1:
        yield (
            f"{owner} has the key {_quoted(extra)} where the example batch has {_quoted(missing)} "
            f"(renamed? {missing[0]!r} → {extra[0]!r})"
        )
    else:
        if missing:
            yield f"{owner} lacks the key{'s' if len(missing) > 1 else ''} {_quoted(missing)} of the example batch"
        if extra:
            yield (
                f"{owner} has the extra key{'s' if len(extra) > 1 else ''} {_quoted(extra)} that the example "
                "batch does not have"
            )
    for key in expected:
        if key in got:
            yield from _differences(f"{path}[{key!r}]", expected[key], got[key])


def _category(value: object) -> str:
    """``mapping``, ``sequence`` (tuple or list), ``tensor`` or ``other``."""
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (tuple, list)):
        return "sequence"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "other"


def _kind_name(value: object) -> str:
    """``a dict``, ``a tuple``, ``a tensor``, ``an int``: the value's type with an article."""
    return _with_article("tensor" if isinstance(value, torch.Tensor) else type(value).__name__)


def _with_article(noun: str) -> str:
    """``a dict``, ``an int64 tensor``."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _tensor_text(tensor: torch.Tensor) -> str:
    """``a float32 tensor of shape (2, 4)``."""
    return _with_article(f"{str(tensor.dtype).removeprefix('torch.')} tensor of shape {tuple(tensor.shape)}")


def _entries(count: int) -> str:
    return f"{count} entr{'y' if count == 1 else 'ies'}"


def _quoted(names: Sequence[object]) -> str:
    """``'a', 'b' and 'c'`` (at most ``_MAX_NAMES`` names, then ``and N more``)."""
    shown = [repr(n) if isinstance(n, str) else str(n) for n in names[:_MAX_NAMES]]
    if not shown:
        return "(none)"
    if len(names) > _MAX_NAMES:
        return ", ".join(shown) + f" and {len(names) - _MAX_NAMES} more"
    if len(shown) == 1:
        return shown[0]
    return ", ".join(shown[:-1]) + " and " + shown[-1]
