"""The options of :func:`torchpar.compile` and :func:`torchpar.plan`, declared once: :class:`CompileOptions`.

Each option is a field of :class:`CompileOptions` — its type, default and docstring here and nowhere else —
validated where it is built. ``compile`` and ``plan`` take them as ``**options``: :func:`with_options` gives both
functions (and their ``torchpar`` shortcuts) the options as keyword-only parameters in their signature
(``inspect.signature``, ``help``) and appends each option's docstring to theirs, read from this file's source.
:class:`CompileKwargs` states the same names and types for static type checkers (``Unpack``); a test keeps the two
equal. Adding an option is a change to this file alone.

Importing this module imports neither torch nor JAX (``torchpar/__init__.py`` imports it): validation imports what
it needs when an options object is built.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np

SpmdMode = Literal["auto", "gspmd", "shard_map"]
SPMD_MODES: tuple[str, ...] = ("auto", "gspmd", "shard_map")
OnNonfinite = Literal["raise", "skip", "ignore"]
ON_NONFINITE: tuple[str, ...] = ("raise", "skip", "ignore")
MatmulPrecision = Literal["highest", "high", "medium"]
MixedPrecision = Literal["bf16", "fp16"]
Remat = Literal["none", "layers", "selective", "auto"]


@dataclasses.dataclass(kw_only=True, frozen=True)
class CompileOptions:
    """Options of :func:`compile` beyond the model, optimizer and method."""

    grad_clip_norm: float | None = None
    """Clip gradients to this global L2 norm before the update (``clip_grad_norm_``); ``None`` = off."""
    seed: int = 0
    """Seed of the PRNG stream that dropout and other random ops draw from; a seed reproduces a run."""
    xla_library_fusions: bool = True
    """On CPU, compile with XLA's YNNPACK and oneDNN library fusions (``jaxbackend.compiler``); ``False``
    keeps XLA's defaults."""
    spmd: SpmdMode = "auto"
    """How a sharded one-stage plan becomes a program. ``"gspmd"``: global shapes, XLA's SPMD partitioner
    inserts the collectives. ``"shard_map"``: a per-device program with explicit collectives
    (``torchpar.runtime.one_stage.spmd_step``; gradients are reduce-scattered as such under ZeRO) for any one-stage
    plan; one it cannot run is an error. ``"auto"``: ``shard_map`` for DataParallel/Zero2/Zero3 plans when it
    can run them (else GSPMD, with the reason logged), GSPMD for the others. ``engine.spmd_mode`` says which
    ran."""
    check_inputs: bool = True
    """Check, before each step and forward, that integer batch values used as indices (token ids, labels,
    gathered positions) are in the range PyTorch accepts (:mod:`torchpar.ir.index_inputs`); XLA would clamp them
    silently. Also that the graph's int64 arithmetic on the batch's integers cannot leave int32's range
    (:mod:`torchpar.ir.integer_ranges`; JAX holds int64 as int32 and would wrap). Costs a min/max per checked input
    on the host."""
    on_nonfinite: OnNonfinite = "raise"
    """A step whose loss or gradients are inf/nan never updates the state (the update is skipped inside the
    executable, as ``torch.amp.GradScaler`` skips ``optimizer.step``). ``"raise"``: then raise
    :class:`~torchpar.runtime.nonfinite.NonFiniteError` naming the step and the first op that produced the
    inf/nan (a diagnostic re-run); ``"skip"``: log it, count it in ``engine.skipped_steps`` and go on;
    ``"ignore"``: apply the update whatever it holds (PyTorch's own behaviour; compiles no check)."""
    matmul_precision: MatmulPrecision | None = None
    """Precision of float32 matrix products and convolutions on a GPU: ``"highest"`` (fp32), ``"high"`` (TF32),
    ``"medium"`` (bf16 passes), as ``torch.set_float32_matmul_precision`` names them. ``None`` follows PyTorch's
    settings at compile time (``torch.get_float32_matmul_precision()``, which ``allow_tf32 = True`` makes
    ``"high"``; convolutions follow ``torch.backends.cudnn.allow_tf32``). The CPU always computes fp32 products.
    ``engine.numerics`` and ``plan.numerics`` say what was compiled."""
    mixed_precision: MixedPrecision | None = None
    """``"bf16"`` / ``"fp16"``: the step runs under ``torch.autocast`` semantics (PyTorch's casting policy is
    captured into the graph: matmuls, convolutions and attention in the low dtype, losses and reductions it keeps
    in float32), with float32 master weights, gradients and optimizer state. ``"fp16"`` adds dynamic loss scaling
    with ``torch.amp.GradScaler``'s rules (``engine.loss_scale``; a step whose gradients overflow is skipped and
    the scale backed off). ``None``: the model's own dtypes."""
    remat: Remat | None = None
    """Activation checkpointing (:mod:`torchpar.planner.remat`): ``"layers"`` keeps only each layer's input for
    the backward and recomputes the layer's forward there; ``"selective"`` also keeps its linear layers' outputs
    and recomputes the cheap rest (norms, activations, softmax, attention scores); ``"none"`` keeps everything.
    ``"auto"``: the planner picks one, the cheapest estimated step that fits the memory budget
    (:mod:`torchpar.planner.remat_choice`; ``plan.solver["remat"]`` says why). A layer is a numbered child of a
    container (``model.layers.3``). Losses are those without remat. ``None``: a given ``Plan``'s ``remat``, else
    ``"none"``. The plan (``plan.remat``) says which ran."""

    profile: bool = False
    """Measured profiling (:mod:`torchpar.engine.profiled`): time all-reduces on this process's devices and plan with
    the fitted link constants, then compile and time the planner's candidates on the devices (a pipeline's refined
    stage partitions, or the one stage) and keep the fastest measured; ``plan.summary()`` shows measured next to
    estimated times. Timings are cached on disk (``TORCHPAR_PROFILE_DIR``,
    :mod:`torchpar.runtime.measure.profile_cache`). Local runtime only. Ignored when ``method`` is a saved ``Plan``."""

    log_every: int = 0
    """Log one line of the step's metrics (:class:`torchpar.metrics.StepMetrics`: loss, step time, samples/s,
    tokens/s, model FLOPs, MFU, memory) every this many steps: to stderr while logging is not configured, else on
    the ``torchpar.metrics`` logger at level INFO (``logging.basicConfig(level=logging.INFO)`` shows it); ``0`` =
    never."""
    on_metrics: Callable[[Any], None] | None = None
    """Called after every step with its :class:`torchpar.metrics.StepMetrics` (``engine.last_metrics``), e.g. to
    stream them to TensorBoard or wandb (``metrics.scalars()``); its exceptions propagate from ``step``."""
    grad_stand_ins: bool = True
    """After each step set ``p.grad`` of every trained parameter to a stand-in (:mod:`torchpar.engine.grad_stand_in`)
    that raises, naming the parameter and the fix, when user code reads it (a manual update, a leftover
    ``optimizer.step()``); ``optimizer.zero_grad()`` clears it. ``False`` leaves ``.grad`` as it is (``None``):
    for a loop that calls ``optimizer.step()`` on purpose after the engine's step, as ``TorchparTrainer`` does."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise TypeError(
                f"seed must be an int (the PRNG stream's seed, like torch.manual_seed's), got {self.seed!r} "
                f"of type {type(self.seed).__name__}"
            )
        if not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int) or self.log_every < 0:
            raise ValueError(f"log_every must be an int ≥ 0 (0 = off), got {self.log_every!r}")
        if self.on_metrics is not None and not callable(self.on_metrics):
            raise TypeError(
                f"on_metrics must be a callable taking the step's metrics, got a {type(self.on_metrics).__name__}"
            )
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ValueError(f"grad_clip_norm must be positive or None, got {self.grad_clip_norm}")
        if self.spmd not in SPMD_MODES:
            raise ValueError(f"spmd must be one of {SPMD_MODES}, got {self.spmd!r}")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {self.on_nonfinite!r}")
        if not isinstance(self.check_inputs, bool):
            raise TypeError(f"check_inputs must be True or False, got {self.check_inputs!r}")
        if not isinstance(self.grad_stand_ins, bool):
            raise TypeError(f"grad_stand_ins must be True or False, got {self.grad_stand_ins!r}")
        from torchpar.capture.precision import autocast_dtype, resolve_precisions
        from torchpar.planner.remat import check_remat

        resolve_precisions(self.matmul_precision)  # raises on a bad name
        autocast_dtype(self.mixed_precision)
        if self.remat is not None:
            check_remat(self.remat, allow_auto=True)


class CompileKwargs(TypedDict, total=False):
    """:class:`CompileOptions`'s fields as keyword arguments, for type checkers (``**options: Unpack[...]``)."""

    grad_clip_norm: float | None
    seed: int
    xla_library_fusions: bool
    spmd: SpmdMode
    check_inputs: bool
    on_nonfinite: OnNonfinite
    matmul_precision: MatmulPrecision | None
    mixed_precision: MixedPrecision | None
    remat: Remat | None
    profile: bool
    log_every: int
    on_metrics: Callable[[Any], None] | None
    grad_stand_ins: bool


PLAN_OPTIONS = ("mixed_precision", "remat", "profile")
"""The options that change a plan (the others change how a compiled step runs): what :func:`torchpar.plan` takes."""


class PlanKwargs(TypedDict, total=False):
    """:data:`PLAN_OPTIONS` as keyword arguments, for type checkers."""

    mixed_precision: MixedPrecision | None
    remat: Remat | None
    profile: bool


def compile_options(
    options: Mapping[str, Any], *, only: tuple[str, ...] | None = None, caller: str = "compile"
) -> CompileOptions:
    """``CompileOptions(**options)``; an unknown name (or, with ``only``, one outside it) is a ``TypeError`` naming the
    options ``caller`` takes."""
    names = only or tuple(f.name for f in dataclasses.fields(CompileOptions))
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise TypeError(
            f"{caller}() got an unexpected keyword argument {unknown[0]!r}; its options are {', '.join(names)}"
            + ("" if only is None else " (the others change how a compiled step runs, not its plan)")
        )
    return CompileOptions(**options)


def with_options(names: tuple[str, ...] | None = None) -> Callable[[Callable], Callable]:
    """Decorate a function taking ``**options``: its signature shows option ``names`` (default: every field of
    :class:`CompileOptions`) as keyword-only parameters with their types and defaults, after its own, and its
    docstring ends with each one's docstring."""

    def decorate(fn: Callable) -> Callable:
        fields = {f.name: f for f in dataclasses.fields(CompileOptions)}
        chosen = names or tuple(fields)
        own = [p for p in inspect.signature(fn).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = [
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=fields[name].default, annotation=fields[name].type
            )
            for name in chosen
        ]
        fn.__signature__ = inspect.signature(fn).replace(parameters=[*own, *added])  # type: ignore[attr-defined]  # inspect reads it
        docs = option_docs()
        listed = "\n".join(f"    - ``{name}``: {_indent(docs[name])}" for name in chosen)
        fn.__doc__ = (
            (fn.__doc__ or "").rstrip() + "\n\n    Options (:class:`torchpar.options.CompileOptions`):\n\n" + listed
        )
        return fn

    return decorate


@functools.cache
def option_docs() -> dict[str, str]:
    """Each option's docstring (the string under its field in :class:`CompileOptions`), read from this file."""
    tree = ast.parse(Path(__file__).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CompileOptions").body
    docs = {}
    for field, after in zip(body, body[1:]):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _indent(text: str) -> str:
    return text.replace("\n", "\n      ")


def numerics_for(matmul_precision: str | None) -> Any:
    """The lowering's :class:`jaxbackend.precision.Numerics` for a ``compile(matmul_precision=...)`` value."""
    from jaxbackend.precision import Numerics
    from torchpar.capture.precision import resolve_precisions

    return Numerics(*resolve_precisions(matmul_precision))


def describe_numerics(numerics: Any, mixed_precision: str | None) -> dict[str, Any]:
    """``Plan.numerics``: the precisions asked and what this platform computes with (see ``Engine.numerics``)."""
    effective = numerics.effective()
    return {
        "matmul_precision": numerics.matmul,
        "conv_precision": numerics.conv,
        "effective": f"{effective.describe()} on {effective.platform}",
        "mixed_precision": mixed_precision or "none",
        "loss_scaling": "dynamic" if mixed_precision == "fp16" else "none",
    }
