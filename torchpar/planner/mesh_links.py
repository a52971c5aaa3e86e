"""Which links a logical mesh axis crosses, and the alpha-beta constants it is priced with.

A stage's submesh is ``(n, D)``: ``n`` hosts × ``D`` devices each (``(1, k)``: ``k`` devices of one host), its
devices numbered host by host (host ``h`` of the submesh holds ``[h·D, (h+1)·D)``). The logical mesh ``(a, b)``
lays those devices out row-major, so a collective over

- axis 1 (size ``b``) runs inside the groups ``{j·b, …, j·b + b − 1}`` of consecutive devices: it stays in one
  host iff ``b`` divides ``D`` (always when ``n = 1``);
- axis 0 (size ``a``) runs inside the groups ``{j, j + b, j + 2b, …}``, which hold a device of the first host
  and one of the last: it crosses hosts iff ``n > 1`` and ``a > 1``.

An axis that stays in a host is priced with the cluster's in-host constants of that axis
(``ClusterSpec.alpha[axis]``, ``ClusterSpec.beta[axis]``); an axis that crosses hosts with its bottleneck link,

    α_axis = max(α_in-host[axis], α_inter-host),     β_axis = max(β_in-host[axis], β_inter-host)

(a ring over the group goes through both kinds of link and runs at the pace of the slower). The stage DP
(:mod:`..stage_cost`) and the sharding ILP (:mod:`.intra_op`) both price collectives with :func:`stage_mesh`,
so the two levels agree on what a spanning mesh costs.
"""

from __future__ import annotations

from typing import cast

from torchpar.hardware import ClusterSpec
from torchpar.planner.sharding.cost_model import LogicalMesh

Shape = tuple[int, int]


def submesh_of(num_devices: int, devices_per_host: int) -> Shape:
    """The physical submesh a one-stage plan of ``num_devices`` devices (the first ones of the cluster) occupies:
    ``(num_devices / D, D)`` whole hosts when it takes more than one host, else ``(1, num_devices)``."""
    if num_devices > devices_per_host and num_devices % devices_per_host == 0:
        return (num_devices // devices_per_host, devices_per_host)
    return (1, num_devices)


def axes_crossing_hosts(submesh: Shape, logical: Shape) -> tuple[bool, bool]:
    """Whether logical axis 0 and axis 1 of ``logical`` on the physical ``submesh`` reach more than one host
    (the module docstring derives the rule)."""
    hosts, per_host = submesh
    outer, inner = logical
    if outer * inner != hosts * per_host:
        raise ValueError(f"logical mesh {logical} does not have the {hosts * per_host} devices of submesh {submesh}")
    if hosts <= 1:
        return (False, False)
    return (outer > 1, inner > 1 and per_host % inner != 0)


def stage_mesh(logical: Shape, cluster: ClusterSpec, submesh: Shape | None = None) -> LogicalMesh:
    """The :class:`LogicalMesh` that prices collectives of a stage with logical mesh ``logical`` placed on
    ``submesh`` (default: the first devices of the cluster, :func:`submesh_of`)."""
    logical = (int(logical[0]), int(logical[1]))
    if submesh is None:
        submesh = submesh_of(logical[0] * logical[1], cluster.devices_per_host)
    crossing = axes_crossing_hosts(submesh, logical)
    alpha = tuple(max(a, cluster.inter_host_alpha) if cross else a for a, cross in zip(cluster.alpha, crossing))
    beta = tuple(max(b, cluster.inter_host_beta) if cross else b for b, cross in zip(cluster.beta, crossing))
    return LogicalMesh(
        shape=logical,
        alpha=cast(tuple[float, float], alpha),  # one per axis, as zipped with the two axes' crossings
        beta=cast(tuple[float, float], beta),
        device_flops=cluster.device_flops,
    )
