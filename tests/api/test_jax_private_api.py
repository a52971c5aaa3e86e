"""The private JAX names torchpar relies on (``jaxbackend/private_api.py``) are still where torchpar reaches for
them, with the signature it calls; on a JAX that moved one, the failure names it, the torchpar file that uses it
and the JAX version."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import jax
import pytest

from jaxbackend.private_api import PRIVATE_USES, PrivateUse

REPO = Path(__file__).resolve().parents[2]
_PRIVATE_IMPORT = re.compile(r"^[ \t]*(?:from\s+(jax\._src[\w.]*)\s+import\s+(?:\(([\w\s,]+)\)|([\w, \t]+))"
                             r"|import\s+(jax\._src[\w.]*))", re.MULTILINE)


def _problem(use: PrivateUse) -> str | None:
    """What is wrong with ``use`` on the installed JAX, or ``None``."""
    try:
        target = importlib.import_module(use.module)
    except ImportError as error:
        return f"its module {use.module} cannot be imported ({error})"
    walked = use.module
    for part in use.name.split("."):
        if not hasattr(target, part):
            return f"{walked} has no attribute {part!r}"
        target, walked = getattr(target, part), f"{walked}.{part}"
    if use.call is not None:
        positional, keywords = use.call
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError) as error:
            return f"its signature cannot be read ({error})"
        try:
            signature.bind(*[None] * positional, **dict.fromkeys(keywords))
        except TypeError as error:
            return (f"its signature is now {use.name}{signature}, which does not take the call torchpar makes "
                    f"({positional} positional argument(s), keywords {list(keywords)}): {error}")
    return None


def _message(use: PrivateUse, problem: str) -> str:
    return (f"\n\n*** PRIVATE JAX API MOVED: {use.symbol} ***\n"
            f"used in {use.used_in}; on JAX {jax.__version__} {problem}.\n"
            f"why torchpar uses it: {use.why}\n"
            f"what to do: {use.if_moved}\n"
            f"(the list of private JAX names torchpar relies on: jaxbackend/private_api.py)\n")


@pytest.mark.parametrize("use", PRIVATE_USES, ids=lambda use: use.symbol)
def test_each_private_jax_name_is_where_torchpar_uses_it(use):
    problem = _problem(use)
    if problem is not None:
        pytest.fail(_message(use, problem), pytrace=False)
    source = (REPO / use.used_in).read_text()
    assert use.name.split(".")[-1] in source, f"{use.used_in} no longer uses {use.symbol}: drop its entry"


def test_every_private_jax_import_in_torchpar_has_an_entry():
    listed = [use.symbol for use in PRIVATE_USES]
    unlisted = []
    for path in sorted([*(REPO / "torchpar").rglob("*.py"), *(REPO / "jaxbackend").rglob("*.py")]):
        if path.name == "private_api.py":
            continue
        for match in _PRIVATE_IMPORT.finditer(path.read_text()):
            module, parenthesized, names, plain = match.groups()
            names = parenthesized or names or ""
            imported = [plain] if plain else [f"{module}.{n.split()[0]}" for n in names.split(",") if n.strip()]
            for name in imported:
                if not any(symbol == name or symbol.startswith(name + ".") for symbol in listed):
                    unlisted.append(f"{path.relative_to(REPO)}: {name}")
    assert not unlisted, ("private JAX imports without an entry in jaxbackend/private_api.py (add one: where, why, "
                          "what to do when it moves): " + ", ".join(unlisted))


def test_a_moved_name_fails_loudly_naming_it_the_file_and_the_jax_version():
    gone = PrivateUse(module="jax._src.xla_bridge", name="no_such_function", call=(0, ()),
                      used_in="torchpar/cluster.py", why="a test", if_moved="nothing")
    resigned = PrivateUse(module="jax._src.lax.parallel", name="all_gather_invariant", call=(2, ("no_such_keyword",)),
                          used_in="jaxbackend/spmd.py", why="a test", if_moved="nothing")
    for use, expected in ((gone, "has no attribute 'no_such_function'"), (resigned, "signature is now")):
        problem = _problem(use)
        assert problem is not None and expected in problem
        message = _message(use, problem)
        assert use.symbol in message and use.used_in in message and jax.__version__ in message
