"""What an :class:`~torchpar.api.Engine` shows about its runs: step metrics, the plan and graph, the compiled programs,
memory, the workers. Read-only; nothing here steps, compiles or moves state.

:class:`EngineReadouts` is the Engine's base class: the Engine owns the fields it reads — ``_executor`` (the
:class:`~torchpar.runtime.executor.Executor`), ``_compiled`` (the :class:`~torchpar.engine.compiled.CompiledTraining`),
``_recorder`` (the :class:`~torchpar.metrics.StepRecorder`), ``_guard`` (the :class:`~torchpar.engine.guard.StepGuard`),
``_loss_scaler``, ``_numerics``, ``_param_names``, ``_last_step_s``, ``_last_signature``, ``_example_signature``,
``options`` and ``model``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchpar import metrics as _metrics
from torchpar.capture.to_ir import dtype_name
from torchpar.cluster import current_cluster
from torchpar.ir.graph import Graph
from torchpar.planner.plan import Plan

if TYPE_CHECKING:
    import torch

    from jaxbackend.precision import Numerics
    from torchpar.engine.batches import Signature
    from torchpar.engine.compiled import CompiledTraining
    from torchpar.engine.guard import StepGuard
    from torchpar.options import CompileOptions
    from torchpar.runtime.executor import Executor
    from torchpar.runtime.loss_scale import LossScaler
    from torchpar.runtime.pipeline.timeline import StepTimeline


class EngineReadouts:
    """The Engine's read-only properties and reports (module docstring: the fields they read)."""

    _executor: Executor
    _compiled: CompiledTraining
    _recorder: _metrics.StepRecorder
    _guard: StepGuard
    _loss_scaler: LossScaler | None
    _numerics: Numerics
    _param_names: dict[str, torch.Tensor]
    _last_step_s: float | None
    _last_signature: Signature | None
    _example_signature: Signature
    options: CompileOptions
    model: torch.nn.Module

    @property
    def last_metrics(self) -> _metrics.StepMetrics | None:
        """The last step's :class:`torchpar.metrics.StepMetrics` (step time, samples/s, tokens/s, model FLOPs, MFU,
        per-device memory, compile timings, loss, loss scale); ``None`` before the first step. Derived when first
        read (the memory once per batch signature: a pipeline compiles its stages once more to read it)."""
        return self._recorder.last(
            lambda: _metrics.MetricsSource(
                graphs=self._compiled.step_graphs,
                num_micro_batches=self._compiled.parts.count,
                precision=_metrics.step_precision(
                    self.options.mixed_precision,
                    self._numerics.effective().matmul,
                    [dtype_name(p.dtype) for p in self._param_names.values()],
                ),
                cluster=current_cluster(),
                plan=self.plan,
                memory_stats=self.memory_stats,
            )
        )

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's gradient norm before clipping (``last_metrics.grad_norm``, derived alone); ``None``
        before."""
        return None if self._recorder.facts is None else self._recorder.facts.grad_norm

    @property
    def loss_scale(self) -> float | None:
        """The dynamic loss scale the next step uses (``mixed_precision="fp16"``), else ``None``."""
        return None if self._loss_scaler is None else self._loss_scaler.scale

    @property
    def numerics(self) -> dict[str, str]:
        """What the step computes with: ``matmul_precision`` / ``conv_precision`` asked, ``effective`` on this
        platform (the CPU computes fp32 products whatever is asked), ``mixed_precision`` and ``loss_scaling``."""
        return dict(self.plan.numerics)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for an inf/nan loss or gradient (``on_nonfinite="skip"``; ``"raise"`` raises instead)."""
        return self._guard.skipped_steps

    def hlo_text(self) -> list[str]:
        """Optimized HLO of each compiled stage of the most recently used step (a pipeline stage's: its forward)."""
        return self._executor.hlo_text()

    @property
    def last_timeline(self) -> StepTimeline | None:
        """Measured compute blocks of each pipeline stage in the last step (``None`` before one)."""
        return self._executor.last_timeline

    def memory_stats(self) -> dict[int, dict[str, int]]:
        """XLA's per-device memory analysis of each compiled stage, ``{stage: {field: bytes}}`` (``docs/api.md``: a
        one-stage plan is stage 0; a pipeline's fields are prefixed ``forward_`` / ``backward_``)."""
        return self._executor.memory_stats()

    def measured(self) -> dict[str, object]:
        """The last step's wall seconds and each stage's per-device memory (:func:`metrics.measured_figures`)."""
        return _metrics.measured_figures(self.plan, self.memory_stats(), self._last_step_s)

    def save_report(self, path: str, **options: object) -> object:
        """The plan's HTML report with the engine's measurements beside the estimates (:func:`metrics.save_report`)."""
        return _metrics.save_report(self.plan, path, self.measured(), self.last_timeline, self.model, **options)

    def describe_workers(self, programs: bool = False) -> list[dict[str, object]]:
        """Each worker process's own account (rank, pid, devices, stages, steps run, devices holding state; with
        ``programs=True`` the HLO it runs per stage and its device assignment)."""
        return self._executor.describe_workers(programs)

    @property
    def executor(self) -> Executor:
        """The :class:`torchpar.runtime.executor.Executor` running the plan."""
        return self._executor

    @property
    def spmd_mode(self) -> str:
        """How the most recently compiled step runs: ``"shard_map"`` (a per-device program with explicit collectives)
        or ``"gspmd"`` (XLA partitions it); ``"single_device"`` (one device); ``"pipeline"`` for a pipeline plan."""
        return self._executor.spmd_mode

    @property
    def compiled_signatures(self) -> int:
        """How many batch signatures have a compiled training step (a new batch shape compiles once)."""
        return len(self._compiled.step_graphs)

    @property
    def plan(self) -> Plan:
        """The execution plan, with every compile phase's seconds in ``timings``."""
        plan = self._compiled.plan
        plan.timings.update(self._compiled.timings)
        return plan

    @property
    def graph(self) -> Graph:
        """The captured training graph (IR) of the most recent batch signature, on one micro-batch."""
        return self._compiled.graph(self._last_signature or self._example_signature)
