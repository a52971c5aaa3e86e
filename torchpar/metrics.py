"""What a training step achieved: throughput, model FLOPs, MFU and memory (``engine.last_metrics``).

The engine times each ``step`` call and hands the raw facts to :func:`step_metrics`, which derives the rest from
the step's captured graph (IR), the cluster description and the plan:

    step_time_s           wall seconds of the ``engine.step`` call (batch transfer, checks, the step, the loss read
                          back; a step that compiled new batch shapes includes that compilation: ``recompiled``)
    samples_per_s         = samples / step_time_s          samples = the batch's dim 0 (its first leaf with a dim)
    tokens_per_s          = tokens / step_time_s           tokens = numel of the token ids (:func:`count_tokens`)
    model_flops_per_step  = 3 · F_fwd · M                  (:func:`model_flops_per_step`)
    mfu                   = model_flops_per_step / step_time_s / (P · D)

``F_fwd`` counts the matrix products of the captured forward graph of one micro-batch (``mm``, ``addmm``, ``bmm``,
``baddbmm``, ``matmul``, ``convolution`` at 2 FLOPs per multiply-add; ``scaled_dot_product_attention`` as its
two products ``Q·Kᵀ`` and ``softmax·V``, the full ``L×S`` score matrix even when causal), ``M`` the micro-batches
of the step; the backward computes two products per forward product (the gradient of each operand), hence 3×.
Not counted: embedding lookups (a gather multiplies nothing), elementwise ops, norms, softmax, losses, the
optimizer update and remat's recomputation. That is PaLM's *model FLOPs* (the ``6·N·T + 12·L·d·S·T`` of a
transformer): what the model needs, not what the hardware executed. Parameters that get no gradient
(frozen layers) are still counted 3×.

``P`` is one device's dense peak FLOP/s at the step's precision (:func:`step_precision`:
``mixed_precision``, else the model's low float dtype, else the effective float32 matmul precision), from the
cluster's hardware preset (:data:`torchpar.hardware.PRESETS`, ``peak_flops``); a precision the device has no
units for falls back to its fp32 peak; a ``device_flops`` set by hand is taken as the peak. ``D`` is the number
of devices the plan uses. Without a preset or a hand-set peak (fake CPU devices: ``device_flops`` is a nominal
figure for pricing plans) there is no real ``P``: ``mfu`` is ``None`` and the log line says "MFU n/a".
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torchpar.ir.graph import Graph
from torchpar.units import format_bytes, format_flops, format_seconds

if TYPE_CHECKING:
    import torch

    from torchpar.hardware import ClusterSpec
    from torchpar.planner.plan import Plan

log = logging.getLogger(__name__)

MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "scaled_dot_product_attention"})
"""The ops whose FLOPs are model FLOPs (ATen op names without namespace and overload)."""

BACKWARD_FACTOR = 2.0
"""Backward FLOPs per forward FLOP of a matrix product (the gradient of each of its two operands)."""

_MATMUL_PRECISION_NAMES = {"highest": "fp32", "high": "tf32", "medium": "bf16"}


@dataclasses.dataclass(kw_only=True, frozen=True)
class StepMetrics:
    """One training step's measurements and derived rates (the module docstring has every formula)."""

    step: int
    """Steps this engine has run, this one included (1 after the first; a restored checkpoint's count goes on)."""
    loss: float
    """The loss ``step`` returned."""
    step_time_s: float
    """Wall seconds of the ``engine.step`` call."""
    samples: int | None
    """Samples in the batch (dim 0 of its first leaf with a dim); ``None`` if every leaf is a scalar."""
    samples_per_s: float | None
    tokens: int | None
    """Token ids in the batch (:func:`count_tokens`); ``None`` when the batch has none (images, features)."""
    tokens_per_s: float | None
    model_flops_per_step: float
    """Forward + backward matrix-product FLOPs of the whole batch (:func:`model_flops_per_step`)."""
    precision: str
    """The precision the peak is taken at: ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``."""
    num_devices: int
    """Devices the plan runs on."""
    peak_flops_per_device: float | None
    """Dense peak FLOP/s of one device at ``precision``; ``None`` when the cluster has no real peak (no hardware
    preset, none detected, and ``device_flops`` left at its nominal default)."""
    mfu: float | None
    """Model FLOPs utilization: ``model_flops_per_step / step_time_s / (peak_flops_per_device · num_devices)``;
    ``None`` (shown "n/a") without a real peak: a ratio to a nominal figure would read as a measurement."""
    memory_bytes: dict[int, int] | None
    """Per-device bytes of each stage's executables by XLA's memory analysis (``{stage: bytes}``,
    :func:`torchpar.runtime.resources.executable_peak_bytes`); ``None`` if the runtime could not say."""
    compile_timings: dict[str, float]
    """Seconds per compile phase (``engine.plan.timings``)."""
    grad_norm: float | None = None
    """The global L2 norm of the step's gradients before clipping (what ``torch.nn.utils.clip_grad_norm_`` returns;
    the true gradients under fp16 loss scaling); inf/nan on a step whose update was skipped for them."""
    loss_scale: float | None
    """The fp16 loss scale this step ran with (``mixed_precision="fp16"``), else ``None``."""
    update_skipped: bool
    """The update was skipped (an inf/nan loss or gradient, or an fp16 overflow)."""
    recompiled: bool
    """This step compiled new batch shapes first (its ``step_time_s`` includes that)."""
    data_wait_s: float = 0.0
    """Seconds the step waited for its data: converting a batch passed to ``step`` (host arrays, placement), waiting
    for ``engine.prefetch``'s next batch, or the slowest process waiting for its host-loaded rows. Near 0 when the
    input pipeline keeps up; near ``step_time_s`` when the step is input-bound."""

    def as_dict(self) -> dict[str, Any]:
        """Every field by name (``memory_bytes`` and ``compile_timings`` as dicts)."""
        return dataclasses.asdict(self)

    def scalars(self) -> dict[str, float]:
        """The numeric fields as one flat ``{name: float}`` (``None`` left out; ``memory_bytes/<stage>``,
        ``compile_s/<phase>``), ready for ``SummaryWriter.add_scalar`` or ``wandb.log``."""
        flat: dict[str, float] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (bool, int, float)):
                flat[field.name] = float(value)
        flat.update({f"memory_bytes/{stage}": float(b) for stage, b in (self.memory_bytes or {}).items()})
        flat.update({f"compile_s/{phase}": float(s) for phase, s in self.compile_timings.items()})
        return flat


def forward_matmul_flops(graph: Graph) -> float:
    """FLOPs of the graph's matrix products (:data:`MATMUL_OPS`), as the IR's nodes carry them."""
    return float(sum(node.flops for node in graph.nodes if _op_name(node.target) in MATMUL_OPS))


def model_flops_per_step(graph: Graph, num_micro_batches: int = 1) -> float:
    """``(1 + BACKWARD_FACTOR) · forward_matmul_flops(graph) · num_micro_batches``: the model FLOPs of a step whose
    graph is one micro-batch's."""
    return (1.0 + BACKWARD_FACTOR) * forward_matmul_flops(graph) * num_micro_batches


def count_tokens(batch: object) -> int | None:
    """Token ids in ``batch``: the number of elements of ``batch["input_ids"]`` for a dict batch holding it, else
    of the first 2-D integer tensor among the batch's leaves (in the order they flatten: a tuple's first entry
    first); ``None`` if there is no such tensor. Padding counts (the rate is of positions computed)."""
    import torch
    import torch.utils._pytree as pytree

    def is_ids(value: object) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.dim() == 2
            and not value.is_floating_point()
            and not value.is_complex()
            and value.dtype != torch.bool
        )

    if isinstance(batch, Mapping) and is_ids(batch.get("input_ids")):
        return int(batch["input_ids"].numel())
    return next((int(leaf.numel()) for leaf in pytree.tree_leaves(batch) if is_ids(leaf)), None)


def count_samples(shapes: Sequence[tuple[int, ...]]) -> int | None:
    """The batch size: dim 0 of the first leaf (by ``shapes``, in flattening order) that has a dim."""
    return next((int(shape[0]) for shape in shapes if len(shape) > 0), None)


def step_precision(mixed_precision: str | None, matmul_precision: str, param_dtypes: Sequence[str] = ()) -> str:
    """The precision a step's products run at: ``mixed_precision`` if given; else ``"bf16"`` / ``"fp16"`` when every
    floating parameter has that dtype; else the effective float32 matmul precision (``"highest"`` → ``"fp32"``,
    ``"high"`` → ``"tf32"``, ``"medium"`` → ``"bf16"``)."""
    if mixed_precision is not None:
        return mixed_precision
    floats = {d for d in param_dtypes if d.startswith(("float", "bfloat"))}
    if floats == {"bfloat16"}:
        return "bf16"
    if floats == {"float16"}:
        return "fp16"
    return _MATMUL_PRECISION_NAMES[matmul_precision]


def peak_flops_per_device(cluster: ClusterSpec, precision: str) -> float | None:
    """One device's dense peak FLOP/s at ``precision``: the cluster preset's ``peak_flops[precision]`` (its fp32
    peak where it has no units for ``precision``), or ``cluster.device_flops`` when it was set by hand (with or
    without a preset); ``None`` when neither says: no preset and the nominal default ``device_flops``."""
    from torchpar.hardware import ClusterSpec, preset

    if cluster.preset is None and cluster.device_flops == ClusterSpec.device_flops:
        return None
    if cluster.preset is not None:
        hardware = preset(cluster.preset)
        if hardware.device_flops == cluster.device_flops:
            return float(hardware.peak_flops.get(precision) or hardware.peak_flops["fp32"] or cluster.device_flops)
    return float(cluster.device_flops)


def mfu(flops_per_step: float, step_time_s: float, peak_per_device: float | None, num_devices: int) -> float | None:
    """``flops_per_step / step_time_s / (peak_per_device · num_devices)``; ``None`` without a peak."""
    if peak_per_device is None:
        return None
    return flops_per_step / step_time_s / (peak_per_device * num_devices)


def step_metrics(
    *,
    step: int,
    loss: float,
    step_time_s: float,
    samples: int | None,
    tokens: int | None,
    flops_per_step: float,
    precision: str,
    peak_per_device: float | None,
    num_devices: int,
    memory_bytes: dict[int, int] | None,
    compile_timings: Mapping[str, float],
    loss_scale: float | None = None,
    update_skipped: bool = False,
    recompiled: bool = False,
    grad_norm: float | None = None,
    data_wait_s: float = 0.0,
) -> StepMetrics:
    """The :class:`StepMetrics` of one step from what the engine measured and knows."""

    def rate(count: int | None) -> float | None:
        return None if count is None else count / step_time_s

    return StepMetrics(
        step=step,
        loss=float(loss),
        step_time_s=step_time_s,
        samples=samples,
        samples_per_s=rate(samples),
        tokens=tokens,
        tokens_per_s=rate(tokens),
        model_flops_per_step=flops_per_step,
        precision=precision,
        num_devices=num_devices,
        peak_flops_per_device=peak_per_device,
        mfu=mfu(flops_per_step, step_time_s, peak_per_device, num_devices),
        memory_bytes=None if memory_bytes is None else dict(memory_bytes),
        compile_timings=dict(compile_timings),
        loss_scale=loss_scale,
        update_skipped=update_skipped,
        recompiled=recompiled,
        grad_norm=grad_norm,
        data_wait_s=data_wait_s,
    )


def measured_figures(
    plan: Plan, memory_stats: Mapping[int, dict[str, int]], last_step_s: float | None
) -> dict[str, object]:
    """What an engine measured, in the form the plan report shows beside its estimates: ``{"step_s": wall seconds
    of the last step (None before one), "memory_bytes": {stage: per-device bytes of the stage's executables by
    XLA's memory analysis}}``. Each stage's figure is also recorded in ``plan`` (``StagePlan.compiled_memory_bytes``),
    so ``plan.summary()`` shows it beside the estimate."""
    from torchpar.runtime.resources import executable_peak_bytes

    memory = {stage: executable_peak_bytes(stats) for stage, stats in memory_stats.items()}
    for stage, nbytes in memory.items():
        if stage < len(plan.stages):
            plan.stages[stage].compiled_memory_bytes = int(nbytes)
    return {"step_s": last_step_s, "memory_bytes": memory}


def save_report(
    plan: Plan, path: str, measured: dict[str, object], timeline: object, model: torch.nn.Module, **options: object
) -> object:
    """``engine.save_report``: the plan's HTML report (``Plan.save_html``) with what the engine measured beside the
    estimates — the last step's wall time, each stage's memory (``engine.measured()``) and, for pipelines, the last
    step's timeline; ``options`` go to ``save_html`` (``param_shapes`` defaults to the model's, ``title``, ...)."""
    measured = dict(measured)
    if measured["step_s"] is None:
        del measured["step_s"]
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    return plan.save_html(path, timeline=timeline, measured=measured, **{"param_shapes": shapes, **options})


def format_line(metrics: StepMetrics) -> str:
    """One log line: ``step 10 | loss 2.3456 | grad norm 0.8123 | 12.3 ms | 325 samples/s | 1.04e+04 tokens/s | 1.2
    GFLOP | MFU 12.3% (bf16 × 8) | memory 32 MiB``."""
    parts = [f"step {metrics.step}", f"loss {metrics.loss:.6g}", format_seconds(metrics.step_time_s)]
    if metrics.grad_norm is not None:
        parts.insert(2, f"grad norm {metrics.grad_norm:.4g}")
    if metrics.samples_per_s is not None:
        parts.append(f"{metrics.samples_per_s:.4g} samples/s")
    if metrics.tokens_per_s is not None:
        parts.append(f"{metrics.tokens_per_s:.4g} tokens/s")
    if metrics.data_wait_s >= 0.1 * metrics.step_time_s and metrics.data_wait_s > 1e-3:
        parts.append(f"waited {format_seconds(metrics.data_wait_s)} for data")
    parts.append(format_flops(metrics.model_flops_per_step))
    shown = "n/a" if metrics.mfu is None else f"{metrics.mfu:.2%}"
    parts.append(f"MFU {shown} ({metrics.precision} × {metrics.num_devices})")
    if metrics.memory_bytes:
        parts.append(f"memory {format_bytes(max(metrics.memory_bytes.values()))}/device")
    if metrics.loss_scale is not None:
        parts.append(f"loss scale {metrics.loss_scale:g}")
    if metrics.update_skipped:
        parts.append("update skipped")
    if metrics.recompiled:
        parts.append("recompiled")
    return " | ".join(parts)


def _op_name(target: str) -> str:
    parts = target.split(".")
    return parts[1] if target.startswith("aten.") and len(parts) > 1 else target


# --- the engine's record ----------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, frozen=True)
class StepFacts:
    """What the engine measured of one step; :class:`StepRecorder` derives the :class:`StepMetrics` from them."""

    step: int
    loss: float
    step_time_s: float
    signature: tuple
    """The batch signature (``torchpar.engine.batches.signature``): its structure and each leaf's shape and dtype."""
    tokens: int | None
    loss_scale: float | None
    update_skipped: bool
    recompiled: bool
    grad_norm: float | None = None
    data_wait_s: float = 0.0


@dataclasses.dataclass(kw_only=True, frozen=True)
class MetricsSource:
    """What deriving a step's metrics reads beside its :class:`StepFacts`."""

    graphs: Mapping[tuple, Graph]
    """Each batch signature's captured step graph (one micro-batch's)."""
    num_micro_batches: int
    precision: str
    """:func:`step_precision`."""
    cluster: ClusterSpec
    plan: Plan

    """The engine's :class:`~torchpar.planner.plan.Plan` (its stages' devices, its compile timings)."""
    memory_stats: Callable[[], dict[int, dict[str, int]]]
    """``engine.memory_stats``: XLA's memory analysis of each stage."""


class StepRecorder:
    """``engine.last_metrics``: the last step's facts, kept by :meth:`record`; the :class:`StepMetrics` derived from
    them by :meth:`last` when first read (the memory once per batch signature: a pipeline compiles its stages once
    more to read it). Logs them every ``log_every`` steps and hands them to ``on_metrics``."""

    def __init__(self, *, log_every: int, on_metrics: Callable[[StepMetrics], None] | None):
        self._log_every = log_every
        self._on_metrics = on_metrics
        self._facts: StepFacts | None = None
        self._metrics: StepMetrics | None = None
        self._memory_by_signature: dict[tuple, dict[int, int] | None] = {}

    @property
    def facts(self) -> StepFacts | None:
        """The last recorded step's facts (``None`` before a step)."""
        return self._facts

    def record(self, facts: StepFacts, read: Callable[[], StepMetrics | None]) -> None:
        """Keep ``facts``; log them every ``log_every`` steps and hand them to ``on_metrics`` (``read``: the engine's
        ``last_metrics``; the metrics are derived only when someone reads them)."""
        self._facts = facts
        self._metrics = None
        if self._log_every and facts.step % self._log_every == 0:
            metrics = read()
            assert metrics is not None  # a step was just recorded
            _announce(f"torchpar: {format_line(metrics)}")
        if self._on_metrics is not None:
            metrics = read()
            assert metrics is not None  # a step was just recorded
            self._on_metrics(metrics)

    def last(self, source: Callable[[], MetricsSource]) -> StepMetrics | None:
        """The last recorded step's metrics (``source()`` is read once, when they are first derived); ``None``
        before a step."""
        facts = self._facts
        if self._metrics is None and facts is not None:
            given = source()
            signature = facts.signature
            self._metrics = step_metrics(
                step=facts.step,
                loss=facts.loss,
                step_time_s=facts.step_time_s,
                samples=count_samples([shape for shape, _ in signature[1]]),
                tokens=facts.tokens,
                flops_per_step=model_flops_per_step(given.graphs[signature], given.num_micro_batches),
                precision=given.precision,
                peak_per_device=peak_flops_per_device(given.cluster, given.precision),
                num_devices=len({d for stage in given.plan.stages for d in stage.devices()}),
                memory_bytes=self._memory_bytes(signature, given.memory_stats),
                compile_timings=given.plan.timings,
                loss_scale=facts.loss_scale,
                update_skipped=facts.update_skipped,
                recompiled=facts.recompiled,
                grad_norm=facts.grad_norm,
                data_wait_s=facts.data_wait_s,
            )
        return self._metrics

    def _memory_bytes(
        self, signature: tuple, memory_stats: Callable[[], dict[int, dict[str, int]]]
    ) -> dict[int, int] | None:
        """Per-device bytes of each stage's executables for ``signature`` (read once), ``None`` if unavailable."""
        from torchpar.runtime.resources import executable_peak_bytes

        if signature not in self._memory_by_signature:
            try:
                stats = memory_stats()
            except Exception as error:
                log.warning("torchpar: no memory statistics for the step's metrics: %s", error)
                stats = None
            self._memory_by_signature[signature] = (
                None if stats is None else {stage: executable_peak_bytes(s) for stage, s in stats.items()}
            )
        return self._memory_by_signature[signature]


def _announce(line: str) -> None:
    """``log_every``'s line: to the ``torchpar.metrics`` logger at INFO once the user has configured logging (a
    handler on it or an ancestor); else straight to stderr, so a bare script sees it without setting logging up."""
    logger = logging.getLogger("torchpar.metrics")
    if logger.hasHandlers():
        logger.info("%s", line)
    else:
        print(line, file=sys.stderr, flush=True)
