"""Data flows down: capture → IR → planner → lowering → runtime. Each import is checked in a fresh
interpreter, through ``sys.modules``, so nothing imported earlier in the test session can hide a violation."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = {
    # importing ...            must not import any module starting with ...
    "jaxbackend.lower": ("torchpar.planner", "torchpar.runtime", "torchpar.report"),
    "jaxbackend.spmd": ("torchpar.planner", "torchpar.runtime", "torchpar.report"),
    "jaxbackend.optim": ("torchpar.planner", "torchpar.runtime", "torchpar.report"),
    "torchpar.planner.plan": ("torchpar.report", "torchpar.runtime", "jax", "torch"),
    "torchpar.ir": ("torch", "jax", "torchpar.planner", "torchpar.runtime", "jaxbackend"),
    "torchpar.ir.layout": ("torch", "jax"),
    "torchpar.ir.graph": ("torch", "jax"),
    "torchpar.ir.optimizer": ("torch", "jax"),
    "torchpar.capture.export": ("jaxbackend", "jax", "torchpar.planner", "torchpar.runtime"),
    "torchpar.capture.optim": ("jaxbackend", "jax", "torchpar.planner", "torchpar.runtime"),
    "torchpar.runtime.worker": ("torch", "torchpar.capture", "torchpar.report", "torchpar.api"),
    "torchpar.runtime.host_actor": ("torch", "torchpar.capture", "torchpar.report", "torchpar.api"),
    "torchpar.runtime.checkpoint_io": ("torch", "torchpar.capture", "torchpar.api"),  # host actors write shards
    "torchpar": ("torch", "jax", "torchpar.planner", "torchpar.runtime"),
    "torchpar.api": ("torchpar.harness", "torchpar.report"),
    "torchpar.report.html": ("torchpar.planner", "torchpar.runtime", "torch", "jax"),  # the Plan is read as data
}


@pytest.mark.parametrize("module", list(CASES))
def test_importing_a_module_does_not_pull_in_higher_floors(module):
    forbidden = CASES[module]
    code = (f"import sys, {module}\n"
            f"bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {forbidden!r}))\n"
            "print('\\n'.join(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing {module} imported {result.stdout.split()}"
