"""``compile(..., profile=True)`` / ``plan(..., profile=True)``: plan with measurements on this process's devices.

Alpa profiles what it plans on the real cluster. Here, before planning, all-reduces are timed on each logical
mesh axis and the cluster's in-host link constants are replaced by the fitted ones
(:func:`torchpar.planner.profiling.calibrated_cluster`); after planning, every candidate the planner refined
(a pipeline's stage partitions; the single stage of a one-stage plan) is compiled and timed, and a pipeline takes
the candidate with the least measured step. ``plan.summary()`` shows the measured next to the estimated times
(``StagePlan.measured_cost_s``, ``plan.solver["profile"]``). Timings are kept on disk
(:mod:`torchpar.runtime.measure.profile_cache`): planning again on the same hardware measures nothing twice.

Only the local runtime is profiled (the driver of the Ray runtime holds no devices).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from torchpar.engine.machine_constants import priced_cluster
from torchpar.hardware import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.ir.optimizer import OptimizerSpec, state_copies
from torchpar.methods import PipeshardParallel
from torchpar.planner.plan import Plan
from torchpar.planner.profiling import LinkFit, StageTimer, calibrated_cluster
from torchpar.planner.training_plan import TrainingPlan, plan_training

if TYPE_CHECKING:
    from jaxbackend.precision import Numerics
    from torchpar.methods import Method

log = logging.getLogger(__name__)


@dataclass
class Profiling:
    """What planning with measurements uses: the cluster with fitted link constants, the stage timer, the fits."""

    cluster: ClusterSpec
    timer: StageTimer
    links: list[LinkFit]
    bar: tqdm

    def record_links(self, plan: Plan) -> None:
        """Add the link fits to ``plan.solver["profile"]`` (the planner records the stages)."""
        if "profile" in plan.solver:
            plan.solver["profile"]["links"] = [fit.to_dict() for fit in self.links]

    def close(self) -> None:
        self.bar.close()


def start_profiling(
    cluster: ClusterSpec,
    *,
    spec: OptimizerSpec,
    trainable: set[str],
    num_micro_batches: int,
    numerics: Numerics,
    library_fusions: bool,
) -> Profiling:
    """Time the links of this process's devices (or read them from the profile cache) and make the stage timer.
    Raises ``ValueError`` on the Ray runtime, whose driver has no devices to measure on."""
    if cluster.runtime != "local":
        raise ValueError(
            "profile=True measures on this process's devices, and the Ray runtime's driver holds none: "
            "profile with torchpar.init(cluster='local', num_devices=...) on one host of the same "
            "hardware, save plan.to_json() and compile with method=torchpar.Plan.from_json(text) on the cluster"
        )
    import jax

    from torchpar.runtime.measure.profile_cache import ProfileCache, profile_dir
    from torchpar.runtime.measure.profiler import StageProfiler, time_links

    devices = jax.devices()
    if len(devices) < cluster.num_devices:
        raise ValueError(
            f"profile=True needs the cluster's {cluster.num_devices} devices in this process; JAX has "
            f"{len(devices)} (torchpar.init(num_devices=...) before JAX is imported)"
        )
    cache = ProfileCache(profile_dir())
    bar = tqdm(desc="torchpar: profiling", unit="stage", leave=False, disable=None)
    links = time_links(cache, devices[: cluster.devices_per_host])
    timer = StageProfiler(
        spec=spec,
        trainable=trainable,
        num_micro_batches=num_micro_batches,
        numerics=numerics,
        library_fusions=library_fusions,
        cache=cache,
        devices=devices,
        on_stage=lambda what: bar.update(1),
    )
    calibrated = calibrated_cluster(cluster, links) if links else cluster
    log.info(
        "profiling: link constants alpha %s, beta %s (were %s, %s); profile cache %s",
        calibrated.alpha,
        calibrated.beta,
        cluster.alpha,
        cluster.beta,
        cache.directory or "off",
    )
    return Profiling(cluster=calibrated, timer=timer, links=links, bar=bar)


@contextlib.contextmanager
def profiling_if(
    profile: bool,
    cluster: ClusterSpec,
    *,
    spec: OptimizerSpec,
    trainable: set[str],
    num_micro_batches: int,
    numerics: Numerics,
    library_fusions: bool,
) -> Iterator[Profiling | None]:
    """``profile=True``: the :class:`Profiling` to plan with inside the ``with`` block (links timed on entering,
    :func:`start_profiling`; its progress bar closed on leaving); else ``None``."""
    if not profile:
        yield None
        return
    profiling = start_profiling(
        cluster,
        spec=spec,
        trainable=trainable,
        num_micro_batches=num_micro_batches,
        numerics=numerics,
        library_fusions=library_fusions,
    )
    try:
        yield profiling
    finally:
        profiling.close()


def finish_profiling(profiling: Profiling | None, plan: Plan) -> None:
    """Record the link fits in ``plan`` (its candidates were timed while planning) and log the measured figures;
    nothing without ``profiling``."""
    if profiling is None:
        return
    profiling.record_links(plan)
    log.info(
        "torchpar: profiled plan:\n%s",
        "\n".join(line for line in plan.summary().splitlines() if "measured" in line or "profiled" in line),
    )


def plan_training_profiled(
    graph: Graph,
    method: Method | Plan | None,
    cluster: ClusterSpec,
    *,
    profile: bool,
    spec: OptimizerSpec,
    trainable: set[str],
    remat: str | None,
    explain: bool = False,
    numerics: Numerics,
    library_fusions: bool,
    beat_s: float = math.inf,
) -> TrainingPlan:
    """:func:`torchpar.planner.training_plan.plan_training` of ``graph``, with measured profiling when ``profile``
    (links timed first, the candidates compiled and timed while planning; a saved :class:`Plan` is taken as it is
    and measures nothing). ``spec``: the optimizer's, for its state copies and the timed steps' update. A cluster
    with the nominal cost constants is priced with this machine's measured ones
    (:mod:`torchpar.engine.machine_constants`). ``beat_s``: as
    :func:`~torchpar.planner.training_plan.plan_training`'s."""
    measure = profile and not isinstance(method, Plan)
    micro = int(getattr(method, "num_micro_batches", 1)) if isinstance(method, PipeshardParallel) else 1
    cluster, constants = priced_cluster(
        cluster, method, graph, trainable=trainable, optimizer_state_copies=state_copies(spec)
    )
    with profiling_if(
        measure,
        cluster,
        spec=spec,
        trainable=trainable,
        num_micro_batches=micro,
        numerics=numerics,
        library_fusions=library_fusions,
    ) as profiling:
        planned = plan_training(
            graph,
            method,
            profiling.cluster if profiling else cluster,
            trainable=trainable,
            optimizer_state_copies=state_copies(spec),
            remat=remat,
            explain=explain,
            stage_timer=profiling.timer if profiling else None,
            beat_s=beat_s,
        )
        finish_profiling(profiling, planned.plan)
    if not isinstance(method, Plan):  # a saved plan keeps the record of what priced it
        planned.plan.solver["cost_constants"] = constants
    return planned
