"""The micro-batch count of a pipeline, searched (``PipeshardParallel(num_micro_batches="auto")``).

A step of B rows cut into M micro-batches of B/M rows on S stages takes, under 1F1B,
``Σ_s t_s(M) + (M − 1)·max_s t_s(M)`` where ``t_s(M)`` is stage s's time per micro-batch. More micro-batches
shrink the bubble (the first term against the second) and the activations a stage keeps in flight (fewer rows
each), so stages fit with less recomputation and on fewer devices; but each micro-batch has fewer rows to split
(a stage's data parallelism is capped by one micro-batch's rows), and every collective's latency is paid M times.
Which count wins depends on the model, the cluster and the memory budget, so each candidate count is captured and
planned, and priced by the same model as every other plan.

Candidates (:func:`candidate_counts`): the counts that divide the batch's rows and are powers of two, and the rows
themselves (one row per micro-batch), scanned from the most micro-batches down (:func:`search_counts`). Each count
is planned with the best step so far as a bound: one whose proven lower bounds cannot beat it is not solved to the
end (:class:`torchpar.planner.remat_choice.NoFasterPlan`). The scan stops after :data:`PATIENCE` consecutive counts that
do not improve on the best (slower, pruned, or not fitting). It is a search, not a proof: the step need not be unimodal
in M, and the record (:func:`search_counts`'s rows) lists every count tried and why it lost."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from torchpar.methods import PipeshardParallel
from torchpar.planner.plan import Plan
from torchpar.planner.remat_choice import NoFasterPlan

log = logging.getLogger(__name__)

PATIENCE = 2
"""Consecutive counts that do not beat the best one before the scan stops."""

Planned = TypeVar("Planned")


def candidate_counts(rows: int) -> list[int]:
    """The micro-batch counts tried for a batch of ``rows`` rows, most micro-batches first: ``rows`` and every power
    of two that divides it. ``rows`` ≥ 1."""
    if rows < 1:
        raise ValueError(f"a batch of {rows} rows has no micro-batch count")
    counts = {rows} | {2**k for k in range(rows.bit_length()) if rows % 2**k == 0}
    return sorted(counts, reverse=True)


def search_counts(
    counts: Sequence[int],
    plan_at: Callable[[int, float], Planned],
    step_of: Callable[[Planned], float],
    patience: int = PATIENCE,
) -> tuple[int, Planned, list[dict]]:
    """The count of ``counts`` (scanned in order) whose plan has the least step, its plan, and one record row per
    count tried (``count``, ``outcome``: ``"planned"`` / ``"pruned"`` / ``"does not fit"``, ``estimated_step_s`` or
    ``step_at_least_s`` or ``error``, ``seconds``).

    ``plan_at(count, beat_s)`` plans with ``count`` micro-batches; it raises
    :class:`torchpar.planner.remat_choice.NoFasterPlan` when its step is provably no less than ``beat_s`` (the best step
    so far; ties go to the count tried first) and ``ValueError`` when nothing fits. ``step_of`` reads a plan's estimated
    step (s). Raises ``ValueError`` listing every count's reason when none planned."""
    best: tuple[int, Planned, float] | None = None
    rows: list[dict] = []
    misses = 0
    for count in counts:
        beat_s = math.inf if best is None else best[2]
        started = time.perf_counter()
        try:
            planned = plan_at(count, beat_s)
        except NoFasterPlan as slower:
            rows.append(
                {
                    "count": count,
                    "outcome": "pruned",
                    "step_at_least_s": slower.step_at_least_s,
                    "seconds": time.perf_counter() - started,
                }
            )
        except ValueError as error:
            rows.append(
                {
                    "count": count,
                    "outcome": "does not fit",
                    "error": str(error).splitlines()[0],
                    "seconds": time.perf_counter() - started,
                }
            )
        else:
            step = step_of(planned)
            rows.append(
                {
                    "count": count,
                    "outcome": "planned",
                    "estimated_step_s": step,
                    "seconds": time.perf_counter() - started,
                }
            )
            if step < beat_s:
                best, misses = (count, planned, step), 0
                log.info("torchpar: %s: estimated step %.4g s, the best so far", _micro_batches(count), step)
                continue
        log.info("torchpar: %s: %s", _micro_batches(count), _describe(rows[-1]))
        misses += best is not None
        if misses >= patience:
            break
    if best is None:
        reasons = "\n  ".join(f"{_micro_batches(row['count'])}: {row['error']}" for row in rows)
        raise ValueError(
            f"no micro-batch count gives a plan that fits:\n  {reasons}\nTry more devices, a larger "
            "memory budget, remat, or a smaller batch."
        )
    return best[0], best[1], rows


def _micro_batches(count: int) -> str:
    return "1 micro-batch" if count == 1 else f"{count} micro-batches"


def _describe(row: dict) -> str:
    if row["outcome"] == "planned":
        return f"estimated step {row['estimated_step_s']:.4g} s, not the best"
    if row["outcome"] == "pruned":
        return f"step at least {row['step_at_least_s']:.4g} s, pruned"
    return f"does not fit ({row['error']})"


def plan_micro_batch_count(
    method: PipeshardParallel,
    rows: int,
    plan_with: Callable[[PipeshardParallel, float], Planned],
    plan_of: Callable[[Planned], Plan],
) -> tuple[int, Planned]:
    """``method`` (``num_micro_batches="auto"``) planned at each of :func:`candidate_counts` ``(rows)`` by
    :func:`search_counts`: ``plan_with(concrete, beat_s)`` captures one micro-batch at ``concrete``'s count and plans
    it (``plan_of`` reads the :class:`Plan` of what it returns). The chosen count and its result, the search's record
    in the plan's ``solver["micro_batches"]``."""
    count, result, tried = search_counts(
        candidate_counts(rows),
        lambda count, beat_s: plan_with(dataclasses.replace(method, num_micro_batches=count), beat_s),
        lambda planned: plan_of(planned).estimated_step_s,
    )
    plan_of(result).solver["micro_batches"] = {"option": "auto", "rows": rows, "chosen": count, "tried": tried}
    return count, result
