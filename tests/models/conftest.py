"""Order the tests of ``test_hf_training.py`` family by family.

Its module-scoped ``trained`` fixture trains each family × optimizer once per process, but pytest-xdist (``make
test``: two workers, ``--dist worksteal``) hands each worker contiguous runs of the collection order, and that order
is test function by test function: a split anywhere in the module left each worker needing every family, and each
trained all of them (10 of the file's trainings twice). Sorted by family (stable: within a family, the file's order),
a split costs at most the family it falls in."""

from __future__ import annotations

import pytest


def _family(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("family") if callspec is not None else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    positions = [i for i, item in enumerate(items)
                 if item.path.name == "test_hf_training.py" and item.path.parent.name == "models"]
    if not positions:
        return
    module = [items[i] for i in positions]
    families = list(dict.fromkeys(_family(item) for item in module))
    ordered = sorted(module, key=lambda item: families.index(_family(item)))
    for i, item in zip(positions, ordered):
        items[i] = item
