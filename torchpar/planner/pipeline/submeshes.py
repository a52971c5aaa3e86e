"""Submeshes of a cluster of ``H`` hosts × ``D`` devices: their shapes, the logical meshes of each, and where
each stage's submesh sits (the cluster device indices it owns; host ``h`` owns ``[h·D, (h+1)·D)``).

Shapes are ``(1, k)`` inside one host (``k`` a power-of-two divisor of ``D``) and ``(n, D)``, ``n`` whole
hosts (:func:`submesh_shapes`); :func:`assign_devices` tiles the cluster with a list of them (why it always
can when the sizes add up is in :mod:`.stages`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

Shape = tuple[int, int]


def submesh_shapes(num_hosts: int, devices_per_host: int) -> tuple[Shape, ...]:
    """Physical submesh shapes ``(hosts, devices per host)``: ``(1, 2^k)`` for ``2^k < D`` dividing ``D``, then
    ``(n, D)`` for ``n = 1..H`` (see the module docstring for why the ``2^k`` must divide ``D``)."""
    _check_cluster(num_hosts, devices_per_host)
    shapes = []
    size = 1
    while size < devices_per_host and devices_per_host % size == 0:
        shapes.append((1, size))
        size *= 2
    shapes.extend((hosts, devices_per_host) for hosts in range(1, num_hosts + 1))
    return tuple(shapes)


def logical_mesh_shapes(submesh: Shape) -> tuple[Shape, ...]:
    """Every 2-D logical mesh ``(a, b)`` with ``a·b`` = the submesh's device count, ``a`` ascending."""
    devices = submesh[0] * submesh[1]
    return tuple((a, devices // a) for a in range(1, devices + 1) if devices % a == 0)


def assign_devices(
    submeshes: Sequence[Sequence[int]], num_hosts: int, devices_per_host: int
) -> tuple[tuple[int, ...], ...]:
    """Device indices (host ``h`` owns ``[h·D, (h+1)·D)``) of each submesh, tiling the cluster exactly.

    Tries stage order first (each stage takes the next free devices, so neighbouring stages sit on
    neighbouring devices), then an exact packing search. ``ValueError`` if the shapes cannot tile the
    cluster.
    """
    _check_cluster(num_hosts, devices_per_host)
    shapes = [tuple(int(x) for x in s) for s in submeshes]
    for index, (hosts, devices) in enumerate(shapes):
        if not (hosts == 1 and 1 <= devices <= devices_per_host) and not (devices == devices_per_host and hosts >= 1):
            raise ValueError(
                f"stage {index}: submesh {(hosts, devices)} is neither (1, k) with k ≤ {devices_per_host} "
                f"nor (n, {devices_per_host}) whole hosts"
            )
    total = sum(h * d for h, d in shapes)
    if total != num_hosts * devices_per_host:
        raise ValueError(
            f"the submeshes {shapes} hold {total} devices, but the cluster has {num_hosts}×"
            f"{devices_per_host} = {num_hosts * devices_per_host}; they must tile it exactly"
        )
    pairs = cast(list[Shape], shapes)  # each unpacked into (hosts, devices) above
    placement = _place_in_order(pairs, num_hosts, devices_per_host) or _place_packed(pairs, num_hosts, devices_per_host)
    if placement is None:
        raise ValueError(
            f"the submeshes {shapes} cannot tile {num_hosts} host(s) of {devices_per_host} devices "
            "without splitting a (1, k) submesh across hosts"
        )
    return placement


def _place_in_order(shapes: list[Shape], num_hosts: int, per_host: int) -> tuple[tuple[int, ...], ...] | None:
    host, offset, result = 0, 0, []
    for hosts, devices in shapes:
        if hosts > 1 or devices == per_host:
            if offset:
                return None
            result.append(tuple(range(host * per_host, (host + hosts) * per_host)))
            host += hosts
        else:
            if offset + devices > per_host:
                return None
            result.append(tuple(range(host * per_host + offset, host * per_host + offset + devices)))
            offset += devices
            if offset == per_host:
                host, offset = host + 1, 0
    return tuple(result)


def _place_packed(shapes: list[Shape], num_hosts: int, per_host: int) -> tuple[tuple[int, ...], ...] | None:
    """Whole-host submeshes on the first hosts, then an exact bin packing of the ``(1, k)`` ones."""
    result: list[tuple[int, ...] | None] = [None] * len(shapes)
    host = 0
    for index, (hosts, devices) in enumerate(shapes):
        if hosts > 1 or devices == per_host:
            result[index] = tuple(range(host * per_host, (host + hosts) * per_host))
            host += hosts
    small = sorted((i for i, (h, d) in enumerate(shapes) if result[i] is None), key=lambda i: -shapes[i][1])
    free = [per_host] * (num_hosts - host)
    where: dict[int, int] = {}

    def place(position: int) -> bool:
        if position == len(small):
            return True
        size = shapes[small[position]][1]
        tried = set()
        for bin_index, room in enumerate(free):
            if room >= size and room not in tried:
                tried.add(room)
                free[bin_index] -= size
                where[small[position]] = bin_index
                if place(position + 1):
                    return True
                free[bin_index] += size
        return False

    if not place(0):
        return None
    used = [0] * len(free)
    for index in sorted(where):
        bin_index, size = where[index], shapes[index][1]
        first = (host + bin_index) * per_host + used[bin_index]
        result[index] = tuple(range(first, first + size))
        used[bin_index] += size
    return tuple(r for r in result if r is not None)


def _check_cluster(num_hosts: int, devices_per_host: int) -> None:
    if num_hosts < 1 or devices_per_host < 1:
        raise ValueError(f"a cluster needs ≥ 1 host and ≥ 1 device per host, got {num_hosts}×{devices_per_host}")
