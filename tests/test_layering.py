"""Data flows down: capture → IR → planner → lowering → runtime. Each import is checked in a fresh
interpreter, through ``sys.modules``, so nothing imported earlier in the test session can hide a violation; and no
module of ``torchpar/`` imports itself back through others, function-local imports included (read with ``ast``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CASES = {
    # importing ...            must not import any module starting with ...
    "jaxbackend.lower": ("torchpar.planner", "torchpar.runtime", "torchpar.report"),
    "jaxbackend.spmd": ("torchpar.planner", "torchpar.runtime", "torchpar.report"),
    "jaxbackend.optimizer": ("torchpar.planner", "torchpar.runtime", "torchpar.report"),
    "torchpar.planner.plan": ("torchpar.report", "torchpar.runtime", "jax", "torch"),
    "torchpar.ir": ("torch", "jax", "torchpar.planner", "torchpar.runtime", "jaxbackend"),
    "torchpar.ir.layout": ("torch", "jax"),
    "torchpar.ir.graph": ("torch", "jax"),
    "torchpar.ir.optimizer": ("torch", "jax"),
    "torchpar.capture.export": ("jaxbackend", "jax", "torchpar.planner", "torchpar.runtime"),
    "torchpar.capture.optimizer": ("jaxbackend", "jax", "torchpar.planner", "torchpar.runtime"),
    "torchpar.runtime.worker": ("torch", "torchpar.capture", "torchpar.report", "torchpar.api"),
    "torchpar.runtime.ray.host_actor": ("torch", "torchpar.capture", "torchpar.report", "torchpar.api"),
    "torchpar.runtime.checkpoint_io": ("torch", "torchpar.capture", "torchpar.api"),  # host actors write shards
    "torchpar.runtime.batch_parts": ("torch", "jax", "torchpar.capture", "torchpar.api"),  # the driver imports it
    "torchpar.runtime.host_loading": ("torch", "torchpar.capture", "torchpar.api", "torchpar.engine.feeding"),
    "torchpar": ("torch", "jax", "torchpar.planner", "torchpar.runtime"),
    "torchpar.api": ("torchpar.harness", "torchpar.report", "torchpar.integrations", "transformers"),
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


# --- no import cycles ---------------------------------------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[1] / "torchpar"

ALLOWED_CYCLES: dict[frozenset[str], str] = {
    # frozenset({"torchpar.a", "torchpar.b"}): "the one-line reason this cycle is necessary",
}
"""Import cycles kept on purpose, each with its reason (none today)."""


def _module_names() -> dict[str, Path]:
    """Every module of ``torchpar/`` by dotted name (a package by its own name, for its ``__init__.py``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The ``torchpar`` modules that module ``name`` imports → the first line importing each: every ``import`` and
    ``from … import`` anywhere in the file (function-local and ``TYPE_CHECKING`` ones too), relative ones resolved;
    ``from package import module`` is an import of the module. ``import a.b.c`` counts as an import of ``a.b.c``
    only: Python also runs ``a/__init__.py`` and ``a/b/__init__.py`` first, but that is how packages load, not a
    dependency (else every module would be in a cycle with ``torchpar/__init__.py``, which imports its floors)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target and target not in modules:  # `import torchpar.x.Name`-like forms: the longest module prefix
            target = target.rpartition(".")[0]
        if target and target != name:
            targets.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source, node.lineno)
    return targets


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module, each sorted."""
    def reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
        seen, stack = {start}, [start]
        while stack:
            for nxt in edges[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    forward = {m: set(targets) for m, targets in graph.items()}
    backward: dict[str, set[str]] = {m: set() for m in graph}
    for m, targets in forward.items():
        for t in targets:
            backward[t].add(m)
    components, placed = [], set()
    for m in sorted(graph):
        if m not in placed:
            component = reachable(m, forward) & reachable(m, backward)
            placed |= component
            if len(component) > 1:
                components.append(sorted(component))
    return components


def _shortest_cycle(start: str, component: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle from ``start`` back to itself inside ``component`` (breadth first)."""
    paths, queue = {start: [start]}, [start]
    while queue:
        module = queue.pop(0)
        for nxt in sorted(graph[module]):
            if nxt == start:
                return paths[module] + [start]
            if nxt in component and nxt not in paths:
                paths[nxt] = paths[module] + [nxt]
                queue.append(nxt)
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")


def test_no_import_cycles_among_torchpar_modules():
    """Data flows down, so no module may reach itself through imports, a function-local import included (it only
    hides the circle from the interpreter). A package's ``__init__.py`` importing its own submodules is an ordinary
    edge: fine unless one of them imports from the package's ``__init__`` back."""
    modules = _module_names()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    found = [c for c in _cycles(graph) if frozenset(c) not in ALLOWED_CYCLES]
    report = []
    for component in found:
        path = _shortest_cycle(component[0], set(component), graph)
        edges = [f"    {a} ({modules[a].relative_to(PACKAGE.parent)}:{graph[a][b]}) → {b}"
                 for a in component for b in sorted(graph[a]) if b in component]
        report.append(f"cycle among {len(component)} modules, e.g. {' → '.join(path)}; its imports:\n"
                      + "\n".join(edges))
    assert not found, "import cycles in torchpar/ (break them, or allow one in ALLOWED_CYCLES with its reason):\n" + \
        "\n".join(report)
    stale = [sorted(c) for c in ALLOWED_CYCLES if sorted(c) not in _cycles(graph)]
    assert not stale, f"ALLOWED_CYCLES lists cycles that no longer exist; remove them: {stale}"


# --- one road ------------------------------------------------------------------------------------------------------


def test_the_engine_is_a_thin_face_that_never_asks_which_method_it_runs():
    """``api.py`` holds the three stages (``capture_step`` → ``Captured`` → ``Planned`` → ``Engine``) and the two
    shortcuts over them, ``compile`` and ``plan``, only (besides private checks); the Engine (≤ 300 lines) and its read-only base
    (``engine_readouts.py``, ≤ 150 lines) name no method class and no pipeline flag: every method takes one road
    (capture → ``plan_training`` → one executor ``compile``)."""
    source = (PACKAGE / "api.py").read_text()
    tree = ast.parse(source)
    top = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    public = [name for name in top if not name.startswith("_")]
    assert public == ["capture_step", "compile", "plan", "Captured", "Planned", "Engine"]
    (engine,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Engine"]
    assert engine.end_lineno - engine.lineno + 1 <= 300
    names = {node.id for node in ast.walk(engine) if isinstance(node, ast.Name)}
    attributes = {node.attr for node in ast.walk(engine) if isinstance(node, ast.Attribute)}
    branching = {"PipeshardParallel", "_pipelined", "is_pipeline", "DataParallel", "ShardParallel"}
    assert not (names | attributes) & branching
    assert "PipeshardParallel" not in source and "_pipelined" not in source
    readouts = (PACKAGE / "engine" / "engine_readouts.py").read_text()
    (base,) = [node for node in ast.parse(readouts).body if isinstance(node, ast.ClassDef)]
    assert engine.bases[0].id == base.name and base.end_lineno - base.lineno + 1 <= 150
    assert not ({node.id for node in ast.walk(base) if isinstance(node, ast.Name)}
                | {node.attr for node in ast.walk(base) if isinstance(node, ast.Attribute)}) & branching


def test_a_stage_problem_travels_as_one_object():
    """``plan_best_mesh → plan_stage → prepare_stage`` pass one frozen :class:`StageProblem`, not keyword lists: each
    takes at most 5 parameters, and a new strategy switch is a field of the problem."""
    import dataclasses
    import inspect

    from torchpar.planner import intra_op

    for fn in (intra_op.plan_best_mesh, intra_op.plan_stage, intra_op.prepare_stage):
        parameters = inspect.signature(fn).parameters
        assert len(parameters) <= 5 and "problem" in parameters, fn.__name__
    assert dataclasses.fields(intra_op.StageProblem) and intra_op.StageProblem.__dataclass_params__.frozen


# --- every floor -----------------------------------------------------------------------------------------------------

FLOORS: list[tuple[str, tuple[str, ...], str]] = [
    ("foundation", ("torchpar.units", "torchpar.hardware", "torchpar.methods", "torchpar.progress",
                    "torchpar.plan_writers", "torchpar.compile_cache", "torchpar.host_heap"),
     "pure data and leaf utilities: units, hardware presets and ClusterSpec, the method options, progress, the report "
     "writer registry, JAX's compile cache settings, the process's malloc settings; they import nothing of torchpar "
     "above them"),
    ("ir", ("torchpar.ir",), "the graph as plain data, and analyses of it (no torch, no JAX)"),
    ("capture", ("torchpar.capture",), "torch.export → IR; reads the IR's types, nothing that plans or runs"),
    ("planner", ("torchpar.planner",), "IR → Plan (layer clustering, stage DP, sharding ILP, schedules); no torch"),
    ("lowering", ("jaxbackend",), "IR + layouts → JAX functions; reads only the IR"),
    ("runtime", ("torchpar.runtime",), "plans → executables on processes and devices (local or Ray)"),
    ("top", ("torchpar",), "the session (cluster.py), the Engine and its rooms, reports, integrations, the CLI"),
]
"""The floors, lowest first, each with the modules it holds (by prefix: the first match wins) and its rule. A module
may import its own floor and the floors below it, never one above — function-local imports included."""


def _floor(module: str) -> int:
    return next(i for i, (_, prefixes, _) in enumerate(FLOORS)
                if any(module == p or module.startswith(p + ".") for p in prefixes))


def _jaxbackend_modules() -> dict[str, Path]:
    root = PACKAGE.parent / "jaxbackend"
    return {".".join(p.relative_to(root.parent).with_suffix("").parts[:-1] if p.name == "__init__.py"
                     else p.relative_to(root.parent).with_suffix("").parts): p for p in sorted(root.rglob("*.py"))}


def test_every_import_points_down_a_floor():
    modules = {**_module_names(), **_jaxbackend_modules()}
    known = {**modules, "jaxbackend": PACKAGE.parent / "jaxbackend" / "__init__.py"}
    upward = []
    for name, path in modules.items():
        for target, line in _imports(name, path, known).items():
            if target.startswith("jaxbackend") or target in modules:
                if _floor(target) > _floor(name):
                    upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({FLOORS[_floor(name)][0]}) imports "
                                  f"{target} ({FLOORS[_floor(target)][0]})")
    assert not upward, "imports that point up a floor:\n  " + "\n  ".join(upward)


def test_no_import_cycles_in_the_lowering():
    """``jaxbackend`` too: the op registry is a leaf the families import; the package imports the families."""
    modules = _jaxbackend_modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert not _cycles(graph), f"import cycles in jaxbackend/: {_cycles(graph)}"


def test_every_room_is_small_and_says_its_job():
    """No folder of ``torchpar/`` holds more than 15 modules, and every package opens with a docstring naming its job
    (a maintainer opens one folder for one bug)."""
    for folder in sorted({path.parent for path in PACKAGE.rglob("*.py")}):
        modules = sorted(folder.glob("*.py"))
        assert len(modules) <= 15, f"{folder.relative_to(PACKAGE.parent)} holds {len(modules)} modules"
        init = folder / "__init__.py"
        assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), f"{folder}: no opening docstring"


# --- typed seams -----------------------------------------------------------------------------------------------------

ANY_BOUND = 169
"""Uses of ``typing.Any`` (``Any`` as a name or ``typing.Any``, read with ``ast``: docstrings and comments do not count)
in ``torchpar/`` and ``jaxbackend/``: 1,214 before mypy joined CI, 169 after. It may only go down: lower it when you
remove some."""


def test_any_stays_rare():
    """A type checker crosses a seam only where the types are named: ``Any`` is kept for values that truly are any
    (a user's batch, a pytree), never as the default (CONTRIBUTING.md, "Types")."""
    count = 0
    for root in (PACKAGE, PACKAGE.parent / "jaxbackend"):
        for path in root.rglob("*.py"):
            count += sum(1 for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, ast.Name) and node.id == "Any"
                         or isinstance(node, ast.Attribute) and node.attr == "Any")
    assert count <= ANY_BOUND, f"{count} uses of Any in torchpar/ and jaxbackend/, over the bound {ANY_BOUND}"
