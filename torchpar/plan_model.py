"""``torchpar.plan``'s work: the model captured on one micro-batch and planned, without XLA or workers; with
``PipeshardParallel(num_micro_batches="auto")`` once per micro-batch count tried
(:mod:`torchpar.planner.pipeline.micro_batch_counts`)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from torchpar.capture.export import LossFn, StepFn, capture_train_step
from torchpar.capture.optimizer import TorchOptimizerBridge
from torchpar.capture.precision import autocast_dtype
from torchpar.capture.semantics.grad_semantics import trainable_params
from torchpar.cluster import current_cluster
from torchpar.engine import batches
from torchpar.engine.profiled import plan_training_profiled
from torchpar.methods import Method, data_replicas, searches_micro_batches
from torchpar.options import MixedPrecision, Remat, describe_numerics, numerics_for
from torchpar.planner.pipeline.micro_batch_counts import plan_micro_batch_count
from torchpar.planner.plan import Plan
from torchpar.progress import CompilePhases


def plan_model(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    example_batch: Any,
    loss_fn: LossFn | None,
    step_fn: StepFn | None,
    method: Method | None,
    explain: bool,
    mixed_precision: MixedPrecision | None,
    remat: Remat,
    profile: bool,
) -> Plan:
    """The plan of :func:`torchpar.plan` (its arguments, already checked); ``plan.timings`` has the capture's
    seconds (the chosen count's) and, for a searched count, ``micro_batch_search``."""
    names = dict(model.named_parameters())
    spec = TorchOptimizerBridge(optimizer, {id(p): n for n, p in names.items()}).spec

    searching = searches_micro_batches(method)
    phases = CompilePhases(() if searching else ("capture", "plan"), "planning the training step")

    def plan_with(concrete: Method | None, beat_s: float = math.inf) -> Plan:
        count = getattr(concrete, "num_micro_batches", 1)
        start = time.perf_counter()
        with phases.phase(f"capture ({count} micro-batches)" if searching else "capture"):
            batch = batches.first_micro_batch(example_batch, count, data_replicas(concrete))
            capture = capture_train_step(
                model, batch, loss_fn, autocast=autocast_dtype(mixed_precision), step_fn=step_fn
            )
        capture_s = time.perf_counter() - start
        with phases.phase(f"plan ({count} micro-batches)" if searching else "plan"):
            planned = plan_training_profiled(
                capture.graph,
                concrete,
                current_cluster(),
                profile=profile,
                spec=spec,
                trainable=set(trainable_params(capture.graph, names, spec.param_names)),
                remat=remat,
                explain=explain,
                numerics=numerics_for(None),
                library_fusions=True,
                beat_s=beat_s,
            ).plan
        planned.timings = {"capture": capture_s, **planned.timings}
        return planned

    try:
        if searching:
            start = time.perf_counter()
            _, result = plan_micro_batch_count(
                method, batches.splittable_rows(example_batch), plan_with, lambda planned: planned
            )
            result.timings["micro_batch_search"] = time.perf_counter() - start
        else:
            result = plan_with(method)
    finally:
        phases.close()
    result.numerics = describe_numerics(numerics_for(None), mixed_precision)
    return result
