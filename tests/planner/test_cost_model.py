"""The alpha-beta formulas and resharding costs, checked against hand arithmetic."""

import pytest

from torchpar.planner.sharding.cost_model import LogicalMesh

MESH = LogicalMesh(shape=(2, 4), alpha=(1e-4, 1e-5), beta=(1e-9, 1e-10))
B = 1 << 20


def test_collective_formulas():
    assert MESH.all_reduce(B, [1]) == pytest.approx(1e-5 + 2 * 1e-10 * 3 / 4 * B)
    assert MESH.all_reduce(B, [0]) == pytest.approx(1e-4 + 2 * 1e-9 * 1 / 2 * B)
    assert MESH.all_gather(B, [1]) == pytest.approx(1e-5 + 1e-10 * 3 / 4 * B)
    assert MESH.reduce_scatter(B, [1]) == pytest.approx(MESH.all_gather(B, [1]))
    assert MESH.all_to_all(B, [1]) == pytest.approx(1e-5 + 1e-10 * 3 / 4 * B / 4)
    assert MESH.all_reduce(B, [0, 1]) == pytest.approx(MESH.all_reduce(B, [0]) + MESH.all_reduce(B, [1]))
    assert LogicalMesh(shape=(1, 4)).all_reduce(B, [0]) == 0.0  # a size-1 axis costs nothing


def test_inner_axis_is_faster_by_default():
    mesh = LogicalMesh(shape=(2, 2))
    assert mesh.all_reduce(B, [1]) < mesh.all_reduce(B, [0])


def test_resharding_costs():
    replicated, rows1, cols1 = (None, None), ((1,), None), (None, (1,))
    assert MESH.resharding(B, rows1, rows1) == 0.0
    assert MESH.resharding(B, replicated, rows1) == 0.0  # a local slice
    assert MESH.resharding(B, rows1, replicated) == pytest.approx(MESH.all_gather(B, [1]))
    assert MESH.resharding(B, rows1, cols1) == pytest.approx(MESH.all_to_all(B / 4, [1]))
    both = (((0, 1)), None)
    # gathering both axes: axis 0 on the 1/4-sized local pieces, then axis 1 on the full tensor
    assert MESH.resharding(B, both, replicated) == pytest.approx(MESH.all_gather(B / 4, [0]) + MESH.all_gather(B, [1]))


def test_mesh_validation():
    with pytest.raises(ValueError):
        LogicalMesh(shape=(0, 4))
