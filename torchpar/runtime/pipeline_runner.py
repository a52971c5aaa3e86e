"""PipeshardParallel execution: build each stage's program on its devices and drive the steps.

``PipelineRunner`` is what the engine holds for a pipeline plan: it splits batches into micro-batches,
runs a step on the chosen runtime (local, or Ray actors per host), and moves the training state in and
out as host arrays.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from jaxbackend import optim as jax_optim
from torchpar.cluster import ClusterSpec
from torchpar.planner.pipeline_plan import PipelinePlan
from torchpar.runtime.local import LocalPipeline, split_micro_batches
from torchpar.runtime.placement import Placement
from torchpar.runtime.schedules import make_schedule
from torchpar.runtime.stage_program import StageProgram

log = logging.getLogger(__name__)


class PipelineRunner:
    """Runs a :class:`PipelinePlan` in this process (the local runtime)."""

    def __init__(self, pipeline: PipelinePlan, *, spec: jax_optim.OptimizerSpec, trainable: set[str],
                 grad_clip_norm: float | None, cluster: ClusterSpec, library_fusions: bool = True):
        self.pipeline = pipeline
        plan = pipeline.plan
        self.num_micro_batches = plan.num_micro_batches
        if cluster.runtime == "ray":
            from torchpar.runtime.ray_runtime import RayPipeline

            self.runtime = RayPipeline(pipeline, spec=spec, trainable=trainable, grad_clip_norm=grad_clip_norm,
                                       library_fusions=library_fusions,
                                       num_hosts=cluster.num_hosts, devices_per_host=cluster.devices_per_host,
                                       cores_per_host=cluster.cores_per_host)
            return
        all_devices = jax.devices()
        self.programs = []
        for stage_graph, stage_plan, device_ids in zip(pipeline.stages, plan.stages, pipeline.devices):
            devices = [all_devices[i] for i in device_ids]
            placement = Placement.from_stage(stage_plan, stage_graph.graph, devices)
            self.programs.append(StageProgram(stage_graph, placement=placement, spec=spec, trainable=trainable,
                                              num_micro_batches=self.num_micro_batches,
                                              library_fusions=library_fusions))
        self.schedule = make_schedule(plan.schedule, len(self.programs), self.num_micro_batches)
        self.runtime = LocalPipeline(self.programs, self.schedule, grad_clip_norm)

    def load(self, params: dict[str, np.ndarray], buffers: dict[str, np.ndarray],
             opt_state: dict[str, dict[str, np.ndarray]]) -> None:
        self.runtime.load(params, buffers, opt_state)

    def warm_up(self, scalars: Any) -> None:
        self.runtime.warm_up(scalars)

    def export(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
        return self.runtime.export()

    def step(self, leaves: list[np.ndarray], scalars: Any, key: Any) -> float:
        return self.runtime.step(split_micro_batches(leaves, self.num_micro_batches), scalars, key)

    def hlo_text(self) -> list[str]:
        return self.runtime.hlo_text()

    def memory_stats(self) -> list[dict[str, int]]:
        return self.runtime.memory_stats()

    def shutdown(self) -> None:
        """Free the runtime's workers (Ray actors); the local runtime holds nothing to free."""
        if hasattr(self.runtime, "shutdown"):
            self.runtime.shutdown()
