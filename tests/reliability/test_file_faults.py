"""Untrusted files never load unsafely, and a bad one is refused with an error naming the bad field.

Plan files are read with ``json`` only and checked field by field (:mod:`torchpar.planner.plan_schema`) before
a :class:`Plan` is built; the HTML report escapes every name a model or a plan file brings into the page.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from html.parser import HTMLParser
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import torchpar
from torchpar.planner.plan import Plan, StagePlan
from torchpar.planner.plan_schema import PLAN_FIELDS, STAGE_FIELDS, PlanFormatError, validate_plan_dict
from torchpar.report.html import render_html


def _valid_plan() -> dict[str, Any]:
    """A two-stage pipeline plan on 2 hosts × 4 devices in its JSON form, using every field."""
    return {
        "method": "pipeshard", "num_micro_batches": 2, "schedule": "1f1b", "estimated_step_s": 0.01,
        "cluster": {"num_hosts": 2, "devices_per_host": 4},
        "solver": {"stage0": {"status": "OPTIMAL", "gap": 0.0}, "runners_up": [{"estimated_step_s": 0.02}]},
        "timings": {"capture": 0.5, "ilp": 0.1},
        "layers": [{"flops": 1e6, "activation_bytes": 64.0}] * 3,
        "layer_of_node": {"addmm": 0, "relu": 1, "addmm_1": 2},
        "stages": [
            {"layers": [0, 1], "submesh_shape": [1, 4], "logical_mesh_shape": [1, 4], "device_ids": [0, 1, 2, 3],
             "params": {"fc.weight": [None, [1]], "fc.bias": [[1]]}, "grads": {"fc.bias": [None]},
             "estimated_cost_s": 3e-3, "estimated_compute_s": 2e-3, "estimated_communication_s": 1e-3,
             "estimated_memory_bytes": 1024, "inputs": {"0": [[1], None]},
             "activations": {"addmm": [[1], None], "split": [[[1], None], None]},
             "operands": {"addmm": [[None], [[1], None], None]}, "strategies": {"addmm": "fc: S1 R"}},
            {"layers": [2], "submesh_shape": [1, 4], "logical_mesh_shape": [2, 2], "device_ids": [4, 5, 6, 7],
             "params": {"head.weight": [[0], [1]]}, "optimizer_state": {"head.weight": [[0, 1], None]},
             "params_at_use": {"head.weight": [None, None]}, "estimated_cost_s": 4e-3},
        ],
    }


def _edit(change: Callable[[dict[str, Any]], Any]) -> str:
    """The valid plan's JSON text after ``change`` edits its dict in place."""
    data = _valid_plan()
    change(data)
    return json.dumps(data)


def _stage(index: int, **fields: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda data: data["stages"][index].update(fields)


def _top(**fields: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda data: data.update(fields)


# (id, file text, field path the error names (None: not JSON), a phrase of the message)
BAD_FILES = [
    ("not-json", '{"method": "shard", "stages": [', None, "not valid JSON: Expecting value at line 1 column 32"),
    ("json-list", "[1, 2]", "", "must be a JSON object"),
    ("nested-too-deep", "[" * 100_000, None, "not valid JSON"),
    ("missing-stages", _edit(lambda d: d.pop("stages")), "stages", "is missing"),
    ("missing-method", _edit(lambda d: d.pop("method")), "method", "is missing"),
    ("empty-stages", _edit(_top(stages=[])), "stages", "non-empty list"),
    ("stage-not-object", _edit(_top(stages=["stage0"])), "stages[0]", "a stage object"),
    ("bad-submesh-shape", _edit(_stage(0, submesh_shape=[1, "a"])), "stages[0].submesh_shape",
     "must be a list of 2 positive ints, got [1, 'a']"),
    ("three-dim-mesh", _edit(_stage(1, logical_mesh_shape=[1, 2, 2])), "stages[1].logical_mesh_shape",
     "a list of 2 positive ints"),
    ("zero-mesh-dim", _edit(_stage(1, logical_mesh_shape=[0, 4])), "stages[1].logical_mesh_shape",
     "a list of 2 positive ints"),
    ("spec-axis-2", _edit(_stage(0, params={"fc.weight": [None, [2]]})), 'stages[0].params["fc.weight"][1]',
     "mesh axes (0 or 1), got [2]"),
    ("spec-axis-twice", _edit(_stage(1, params={"head.weight": [[1], [1]]})), 'stages[1].params["head.weight"]',
     "at most one dim over each mesh axis"),
    ("param-spec-string", _edit(_stage(0, params={"fc.weight": "S1 R"})), 'stages[0].params["fc.weight"]',
     "must be a spec"),
    ("params-not-object", _edit(_stage(0, params=[["fc.weight", [None]]])), "stages[0].params", "an object"),
    ("grad-spec-bool-axis", _edit(_stage(0, grads={"fc.bias": [[True]]})), 'stages[0].grads["fc.bias"][0]',
     "mesh axes"),
    ("operand-spec-bad", _edit(_stage(0, operands={"addmm": [[None], "R"]})), 'stages[0].operands["addmm"][1]',
     "must be a spec"),
    ("mesh-not-submesh", _edit(_stage(1, logical_mesh_shape=[2, 4])), "stages[1].logical_mesh_shape",
     "submesh's 4 devices"),
    ("mesh-product-not-device-count", _edit(_stage(1, device_ids=[4, 5, 6])), "stages[1].device_ids",
     "4 device ids"),
    ("duplicate-device-ids", _edit(_stage(1, device_ids=[4, 5, 5, 6])), "stages[1].device_ids",
     "device 5 is listed twice"),
    ("negative-device-id", _edit(_stage(0, device_ids=[0, 1, -2, 3])), "stages[0].device_ids[2]", "int ≥ 0"),
    ("device-outside-cluster", _edit(_stage(1, device_ids=[4, 5, 6, 8])), "stages[1].device_ids",
     "below 8"),
    ("mesh-bigger-than-cluster", _edit(lambda d: d["stages"][1].update(submesh_shape=[4, 4], logical_mesh_shape=[4, 4],
                                                                        device_ids=[])),
     "stages[1].logical_mesh_shape", "at most the 8 devices"),
    ("layer-id-string", _edit(_stage(0, layers=[0, "1"])), "stages[0].layers[1]", "int ≥ 0, got '1'"),
    ("duplicate-layer-ids", _edit(_stage(0, layers=[0, 0])), "stages[0].layers", "layer 0 is listed twice"),
    ("unknown-method", _edit(_top(method="tensor_parallel")), "method", "'data_parallel'"),
    ("num-micro-batches-0", _edit(_top(num_micro_batches=0)), "num_micro_batches", "an int ≥ 1, got 0"),
    ("num-micro-batches-bool", _edit(_top(num_micro_batches=True)), "num_micro_batches", "an int ≥ 1, got True"),
    ("unknown-schedule", _edit(_top(schedule="zigzag")), "schedule", "'1f1b'"),
    ("pipeline-without-schedule", _edit(lambda d: d.pop("schedule")), "schedule", "for a pipeshard plan"),
    ("one-stage-method-two-stages", _edit(_top(method="data_parallel")), "stages", "exactly 1 stage"),
    ("cost-not-number", _edit(_stage(0, estimated_cost_s="3 ms")), "stages[0].estimated_cost_s", "a number"),
    ("cost-nan", _edit(_top(estimated_step_s=float("nan"))), "estimated_step_s", "a number"),
    ("memory-float", _edit(_stage(0, estimated_memory_bytes=1.5)), "stages[0].estimated_memory_bytes",
     "an int ≥ 0"),
    ("timing-not-number", _edit(_top(timings={"ilp": None})), 'timings["ilp"]', "a number"),
    ("cluster-unknown-key", _edit(_top(cluster={"num_hosts": 2, "gpus": 4})), "cluster.gpus",
     "devices_per_host, inter_host_alpha, inter_host_beta, num_hosts"),
    ("layer-of-node-negative", _edit(_top(layer_of_node={"addmm": -1})), 'layer_of_node["addmm"]', "int ≥ 0"),
    ("strategy-not-string", _edit(_stage(0, strategies={"addmm": 3})), 'stages[0].strategies["addmm"]',
     "a string"),
    ("unknown-top-level-key", _edit(_top(__class__="os.system")), "__class__",
     "is unknown; a plan has the fields cluster, estimated_step_s, layer_of_node, layers, method"),
    ("unknown-stage-key", _edit(_stage(0, pickle="cos\nsystem")), "stages[0].pickle", "is unknown; a stage"),
]


@pytest.mark.parametrize(("text", "field", "phrase"), [case[1:] for case in BAD_FILES],
                         ids=[case[0] for case in BAD_FILES])
def test_a_malformed_plan_file_is_refused_naming_the_field(tmp_path, text, field, phrase):
    path = tmp_path / "plan.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PlanFormatError) as caught:
        Plan.from_json(path.read_text(encoding="utf-8"))
    assert caught.value.field == field
    message = str(caught.value)
    assert phrase in message
    if field:
        assert f"plan field {field} " in message
    assert isinstance(caught.value, ValueError)  # callers catching ValueError keep working


def test_the_valid_base_plan_loads_and_round_trips():
    text = json.dumps(_valid_plan())
    plan = Plan.from_json(text)
    assert plan.is_pipeline and plan.stages[1].logical_mesh_shape == (2, 2)
    assert plan.layer_of_node == {"addmm": 0, "relu": 1, "addmm_1": 2}
    assert Plan.from_json(plan.to_json()).to_dict() == plan.to_dict()


def test_a_former_method_name_still_loads():
    data = copy.deepcopy(_valid_plan())
    data.update(method="auto", schedule="none", stages=data["stages"][:1])
    assert Plan.from_dict(data).method == "shard"


def test_from_dict_checks_in_memory_dicts_too():
    data = _valid_plan()
    data["stages"][0]["submesh_shape"] = (1, 4.0)
    with pytest.raises(PlanFormatError, match=r"plan field stages\[0\]\.submesh_shape must be"):
        Plan.from_dict(data)
    with pytest.raises(PlanFormatError, match="must be a JSON object"):
        validate_plan_dict("{}")


def test_the_schema_knows_every_field_of_the_dataclasses():
    assert set(PLAN_FIELDS) == {f.name for f in dataclasses.fields(Plan)}
    assert set(STAGE_FIELDS) == {f.name for f in dataclasses.fields(StagePlan)}
    required = {f.name for f in dataclasses.fields(StagePlan)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert required == {name for name, (needed, _) in STAGE_FIELDS.items() if needed}


class TinyMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("method", [None, torchpar.DataParallel()], ids=["single-device", "data-parallel"])
def test_a_real_plan_passes_validation_and_round_trips(method):
    torch.manual_seed(0)
    model = TinyMLP()
    plan = torchpar.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(8, 4),
                         loss_fn=lambda out, batch: out.sum(), method=method)
    validate_plan_dict(plan.to_dict())
    validate_plan_dict(json.loads(plan.to_json()))
    assert Plan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()
    loaded = Plan.from_json(plan.to_json())
    assert loaded.to_dict() == json.loads(plan.to_json())
    assert set(loaded.stages[0].params) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


# --- the HTML report escapes what a model or a plan file brings in ----------------------------------------

SCRIPT = "<script>alert(1)</script>"
ATTRIBUTE = 'x"onmouseover="y'
"""Breaks out of a double-quoted attribute. torch.fx writes module names into the Python source it generates
between double quotes, so a model cannot have this name (capture fails with a SyntaxError); plan files can."""
QUOTE = "x'onmouseover='y"
"""Breaks out of a single-quoted attribute, as the report writes them."""


class _Elements(HTMLParser):
    """Every start tag of a page, with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    handle_startendtag = handle_starttag


def _assert_nothing_injected(page: str) -> None:
    """The page's only script is its own (the last element's), and no element got an event-handler attribute."""
    parser = _Elements()
    parser.feed(page)
    assert [tag for tag, _ in parser.tags].count("script") == 1
    assert not [(tag, attrs) for tag, attrs in parser.tags if any(name.startswith("on") for name in attrs)]
    assert SCRIPT not in page and ATTRIBUTE not in page and QUOTE not in page


class EvilNames(torch.nn.Module):
    """Parameters whose names carry HTML: a script tag and an attribute break-out."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleDict({SCRIPT: torch.nn.Linear(4, 4), QUOTE: torch.nn.Linear(4, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[QUOTE](torch.relu(self.blocks[SCRIPT](x)))


def test_the_html_report_escapes_parameter_names(tmp_path):
    model = EvilNames()
    plan = torchpar.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(2, 4),
                         loss_fn=lambda out, batch: out.sum(), method=None)
    assert f"blocks.{SCRIPT}.weight" in plan.stages[0].params
    plan.save_html(tmp_path / "r.html", param_shapes={n: list(p.shape) for n, p in model.named_parameters()},
                   title=f"report {SCRIPT}")
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    _assert_nothing_injected(page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "x&#x27;onmouseover=&#x27;y" in page
    loaded = Plan.from_json(plan.to_json())  # the names survive the file and stay escaped
    assert set(loaded.stages[0].params) == set(plan.stages[0].params)
    _assert_nothing_injected(render_html(loaded))


def test_the_html_report_escapes_plan_file_strings_and_timeline_labels():
    data = _valid_plan()
    data["solver"] = {SCRIPT: ATTRIBUTE, "stage0": {QUOTE: SCRIPT}, "runners_up": [SCRIPT, {"description": QUOTE}]}
    data["timings"] = {SCRIPT: 0.1, QUOTE: 0.2}
    data["stages"][0]["params"] = {SCRIPT: [None, [1]], ATTRIBUTE: [[1]], QUOTE: [None]}
    plan = Plan.from_json(json.dumps(data))
    page = render_html(plan, title=QUOTE)
    _assert_nothing_injected(page)
    assert "x&quot;onmouseover=&quot;y" in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    block = SimpleNamespace(op="forward", micro_batch=QUOTE, start=0.0, end=1.0)  # a runtime timeline's block
    _assert_nothing_injected(render_html(plan, timeline=[[block], [block]]))
