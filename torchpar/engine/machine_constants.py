"""The cost constants a plan is priced with when nobody gave them: measured on this machine, once, then cached.

``torchpar.init`` gives a :class:`~torchpar.cluster.ClusterSpec` whose cost constants come from one of three places:
a hardware preset (``preset=`` or a detected GPU), fields set by hand (``init(..., device_flops=...)``), or the
nominal defaults, which describe no machine. In the last case, on the local runtime, the planner prices the plan
with constants measured here instead (:mod:`torchpar.runtime.measure.calibration`): the effective training FLOP/s of one
device while the devices the plan keeps busy all run (one for ``method=None``, every device of the cluster
otherwise), the time each op and each updated parameter adds, and the all-reduce links between them. The
measurement takes a few seconds the first time and is kept
in the profile cache (``~/.cache/torchpar/profiles``, ``TORCHPAR_PROFILE_DIR``).

The engine's cluster itself is not changed (MFU still has no peak to divide by: a measured rate is not a peak);
the plan records what priced it: ``plan.cluster`` holds the measured constants and ``plan.solver["cost_constants"]``
how they were obtained.

``TORCHPAR_COST_CONSTANTS=nominal`` keeps the nominal defaults (reproducible plans across machines: the test suite
sets it); ``measured`` (the default) measures. The Ray runtime keeps the nominal defaults: its driver holds no
devices to measure on (give a preset or constants by hand, or plan with ``profile=True`` on one host); so does a plan
for more devices than this process has.
"""

from __future__ import annotations

import logging
import os
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from torchpar import progress
from torchpar.hardware import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.ir.op_families import FREE
from torchpar.planner.plan import Plan
from torchpar.planner.profiling import calibrated_cluster

if TYPE_CHECKING:
    from torchpar.methods import Method

log = logging.getLogger(__name__)

ENV_VAR = "TORCHPAR_COST_CONSTANTS"
CHOICES = ("measured", "nominal")
COST_FIELDS = ("device_flops", "alpha", "beta", "inter_host_alpha", "inter_host_beta")
"""The :class:`ClusterSpec` fields that price time (memory is the budget, never measured)."""


def chosen_source() -> str:
    """``TORCHPAR_COST_CONSTANTS`` (``measured`` when unset); ``ValueError`` naming the choices otherwise."""
    value = os.environ.get(ENV_VAR, "measured").strip().lower() or "measured"
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR}={value!r}: use one of {', '.join(CHOICES)}")
    return value


def constants_origin(cluster: ClusterSpec) -> str:
    """Where ``cluster``'s time constants come from: ``"preset"``, ``"by hand"`` or ``"nominal"``."""
    if cluster.preset is not None:
        return "preset"
    defaults = {f.name: f.default for f in fields(ClusterSpec) if f.name in COST_FIELDS}
    return "nominal" if all(getattr(cluster, name) == value for name, value in defaults.items()) else "by hand"


def busy_devices(method: Method | Plan | None, cluster: ClusterSpec) -> int:
    """Devices a plan of ``method`` keeps running at once: 1 for ``method=None``, else the whole cluster."""
    return 1 if method is None else cluster.num_devices


def priced_cluster(
    cluster: ClusterSpec,
    method: Method | Plan | None,
    graph: Graph,
    *,
    trainable: set[str] | None = None,
    optimizer_state_copies: float = 2.0,
) -> tuple[ClusterSpec, dict[str, object]]:
    """``(the cluster to plan ``graph`` with, the record of its constants)`` by the module docstring's rules; the
    record goes to ``plan.solver["cost_constants"]``. ``trainable`` (default: every parameter) and
    ``optimizer_state_copies`` price the optimizer update. A saved :class:`Plan` is not planned again: nothing is
    measured."""
    origin = constants_origin(cluster)
    if isinstance(method, Plan):
        return cluster, {"source": "saved plan"}
    if origin != "nominal":
        return cluster, {"source": f"{cluster.preset} preset" if origin == "preset" else "set by hand"}
    if chosen_source() == "nominal":
        return cluster, {"source": f"nominal defaults ({ENV_VAR}=nominal)"}
    if cluster.runtime != "local":
        log.info(
            "torchpar: the Ray runtime's driver holds no devices to measure: plans are priced with the nominal "
            "cost constants (give init(preset=...) or the constants by hand)"
        )
        return cluster, {"source": "nominal defaults (Ray runtime: nothing to measure in the driver)"}
    import jax

    from torchpar.runtime.measure.calibration import measure_machine
    from torchpar.runtime.measure.profile_cache import ProfileCache, profile_dir

    busy = busy_devices(method, cluster)
    if len(jax.devices()) < busy:  # planning for devices this process does not have (a meta-device model, say)
        return cluster, {
            "source": f"nominal defaults (the plan's {busy} devices are not in this process: {len(jax.devices())} here)"
        }
    devices = jax.devices()[:busy]
    progress.note(f"this machine's cost constants on {busy} device(s) (measured once, then cached)")
    measured = measure_machine(ProfileCache(profile_dir()), devices)
    ops = sum(1 for node in graph.nodes if node.target not in FREE)
    params = float(
        sum(i.meta.numel for i in graph.inputs if i.kind == "param" and (trainable is None or i.target in trainable))
    )
    device_flops = measured.effective_flops(graph.total_flops, ops, params, optimizer_state_copies)
    priced = replace(calibrated_cluster(cluster, measured.links), device_flops=device_flops)
    return priced, {**measured.to_dict(), "device_flops": device_flops, "graph_ops": ops, "graph_params": params}
