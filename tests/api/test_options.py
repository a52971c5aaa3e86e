"""The options of ``compile`` and ``plan`` are declared once (``torchpar/options.py``): both functions and their
``torchpar`` shortcuts show them from there, and the static declaration for type checkers cannot drift."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
import torch

import torchpar
from torchpar import api, options
def test_the_static_declaration_matches_the_options():
    fields = {f.name: f.type for f in dataclasses.fields(options.CompileOptions)}
    declared = {name: hint.__forward_arg__ if isinstance(hint, typing.ForwardRef) else hint
                for name, hint in options.CompileKwargs.__annotations__.items()}
    assert declared == fields  # same names, same types, same order
    assert list(options.PlanKwargs.__annotations__) == list(options.PLAN_OPTIONS)
    assert all(options.PlanKwargs.__annotations__[n] == options.CompileKwargs.__annotations__[n]
               for n in options.PLAN_OPTIONS)


def test_every_option_has_its_docstring_in_compile_and_plan_help():
    docs = options.option_docs()
    assert set(docs) == {f.name for f in dataclasses.fields(options.CompileOptions)}
    for fn in (torchpar.compile, api.compile):
        for name, doc in docs.items():
            assert f"``{name}``: {doc.splitlines()[0]}" in fn.__doc__, name
    for name in options.PLAN_OPTIONS:
        assert f"``{name}``: " in torchpar.plan.__doc__
    assert "``seed``" not in torchpar.plan.__doc__


def test_plan_takes_the_options_that_change_a_plan_and_names_them_when_given_another():
    public, core = inspect.signature(torchpar.plan).parameters, inspect.signature(api.plan).parameters
    assert list(public) == list(core) and list(public)[-3:] == list(options.PLAN_OPTIONS)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"plan\(\) got an unexpected keyword argument 'seed'; its options are "
                                        r"mixed_precision, remat, profile \(the others change how a compiled step"):
        torchpar.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(4, 2), seed=3)
    with pytest.raises(ValueError, match="remat"):
        torchpar.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(4, 2),
                      remat="sometimes")
