"""``remat="auto"``: the planner picks the activation checkpointing a plan runs with.

For each option ``r`` in ``("none", "selective", "layers")`` the plan is made as if the user had asked for ``r``
(the ILP, or the stage DP and each stage's ILP, price ``r``'s kept activations against the memory budget and its
recomputed FLOPs in the step time: :func:`torchpar.planner.remat.remat_memory`). The chosen plan is

    argmin over the options whose plan fits of  (estimated step seconds, position in that order)

(an option whose planning proves its step no better than an option planned before it — :class:`NoFasterPlan` — is
not planned to the end: a pipeline plans the options least screened step first and bounds each by the best so far)
so remat is taken only when it is needed to fit, or when it lets the ILP pick a faster sharding than the one that
fits without it (e.g. data parallelism instead of sharded activations). ``plan.solver["remat"]`` records every
candidate (its step and memory estimates, or why it did not fit) and the reason in words; ``plan.remat`` is the
choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torchpar.planner.plan import Plan
from torchpar.planner.remat import REMAT_OPTIONS
from torchpar.units import format_bytes, format_seconds

log = logging.getLogger(__name__)

ORDER = ("none", "selective", "layers")
"""Candidates, cheapest in compute first: ties go to the earlier one."""
assert set(ORDER) == set(REMAT_OPTIONS)
PIPELINE_ORDER = ("selective", "none", "layers")
"""A pipeline plans the options least screened step first (the stage DP's estimate); this order breaks its ties: the
likeliest winner at scale first, so that its step bounds the others (GPT-3 175B on 64 × 8: "none" is tight on memory
and its ILP slow; "layers" recomputes every layer)."""


class NoFasterPlan(ValueError):
    """An option's plan was proven no faster than ``beat_s`` (another option's step) before it was solved to the end:
    its step is at least ``step_at_least_s``."""

    def __init__(self, step_at_least_s: float, beat_s: float):
        super().__init__(
            f"its step is at least {step_at_least_s:.6g} s by the ILP's lower bounds, no better than "
            f"{beat_s:.6g} s: not solved to the end"
        )
        self.step_at_least_s, self.beat_s = step_at_least_s, beat_s


def choose_remat(make_plan: Callable[[str], Plan], budget_bytes: float, order: tuple[str, ...] = ORDER) -> Plan:
    """The plan of the best option (module docstring). ``make_plan(remat)`` plans with one option and raises
    ``ValueError`` when nothing fits (:class:`NoFasterPlan` when it proved the option slower than one planned before or
    elsewhere; if every option that fits was, :class:`NoFasterPlan` is raised here too);
    a plan whose estimated per-device memory exceeds ``budget_bytes`` (the single-device plan, which has no solver to
    refuse it) does not fit either. ``order``: the order the options are planned in (the record lists them in
    :data:`ORDER`). Raises ``ValueError`` listing each option's reason when none fits."""
    plans: dict[str, Plan] = {}
    candidates: list[dict] = []
    errors: list[ValueError] = []
    slower_than: list[NoFasterPlan] = []
    for remat in order:
        try:
            plan = make_plan(remat)
        except NoFasterPlan as slower:
            slower_than.append(slower)
            candidates.append(
                {
                    "remat": remat,
                    "fits": None,
                    "pruned": True,
                    "step_at_least_s": slower.step_at_least_s,
                    "error": str(slower),
                }
            )
            continue
        except ValueError as error:
            candidates.append({"remat": remat, "fits": False, "error": str(error).splitlines()[0]})
            errors.append(error)
            continue
        peak = max(stage.estimated_memory_bytes for stage in plan.stages)
        fits = peak <= budget_bytes
        row = {"remat": remat, "fits": fits, "estimated_step_s": plan.estimated_step_s, "estimated_memory_bytes": peak}
        if not fits:
            row["error"] = f"needs {format_bytes(peak)} per device, over the {format_bytes(budget_bytes)} budget"
        else:
            plans[remat] = plan
        candidates.append(row)
    candidates.sort(key=lambda row: ORDER.index(row["remat"]))
    if not plans and slower_than:  # every option that fits is provably no faster than a plan made elsewhere
        raise NoFasterPlan(min(s.step_at_least_s for s in slower_than), min(s.beat_s for s in slower_than))
    if not plans and len(errors) == len(ORDER) and len({str(e) for e in errors}) == 1:
        raise errors[
            0
        ]  # the same error whatever remat does (a mesh larger than the cluster, a batch that does not split)
    if not plans:
        reasons = "\n  ".join(f"remat={c['remat']!r}: {c['error']}" for c in candidates)
        raise ValueError(
            f"no plan fits {format_bytes(budget_bytes)} per device with any activation checkpointing:"
            f"\n  {reasons}\nTry more devices, a larger memory budget, smaller (micro-)batches "
            "(num_micro_batches) or Zero3Parallel."
        )
    chosen = min(plans, key=lambda r: (plans[r].estimated_step_s, ORDER.index(r)))
    plan = plans[chosen]
    plan.remat = chosen
    plan.solver["remat"] = {
        "option": "auto",
        "chosen": chosen,
        "candidates": candidates,
        "reason": _reason(chosen, candidates, budget_bytes),
    }
    log.info("torchpar: remat='auto' chose %r: %s", chosen, plan.solver["remat"]["reason"])
    return plan


def _reason(chosen: str, candidates: list[dict], budget_bytes: float) -> str:
    by_name = {c["remat"]: c for c in candidates}
    none = by_name["none"]
    step = by_name[chosen]["estimated_step_s"]
    if chosen == "none":
        return (
            f"without remat the step fits ({format_bytes(none['estimated_memory_bytes'])} of "
            f"{format_bytes(budget_bytes)} per device, est. {format_seconds(step)}); recomputing would only add "
            "compute"
        )
    if none.get("pruned"):
        return (
            f"{chosen!r} is the fastest plan that fits ({format_bytes(by_name[chosen]['estimated_memory_bytes'])} "
            f"per device, est. {format_seconds(step)}); without remat the step is at least "
            f"{format_seconds(none['step_at_least_s'])} (bounded, not solved to the end)"
        )
    if not none["fits"]:
        return (
            f"without remat nothing fits {format_bytes(budget_bytes)} per device ({none['error']}); "
            f"{chosen!r} fits ({format_bytes(by_name[chosen]['estimated_memory_bytes'])}) at the lowest "
            f"estimated step among those that fit, {format_seconds(step)}"
        )
    return (
        f"{chosen!r} lets the plan fit a faster sharding: est. {format_seconds(step)} against "
        f"{format_seconds(none['estimated_step_s'])} without remat"
    )
