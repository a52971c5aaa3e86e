"""Every surface of a plan report shows the same numbers: the header cards, the stage table (and the step it
adds up to), the cost bars, the runners-up, the timeline's marker and the PNG's texts all equal the plan's
estimates (``Plan.estimated_step_s``, ``StagePlan.estimated_*``), as exact ``data-*`` values and as the text
:mod:`torchpar.units` prints. Plans are made by :func:`torchpar.plan` on tiny GPT-2s: a pipeline on 2 simulated
hosts × 4 devices (with runners-up) and a ShardParallel plan on 8 devices (with the hand-plan comparison)."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import pytest
import torch

import torchpar
from tests.report.html_page import Page
from torchpar.harness import zoo
from torchpar.planner.mesh_links import axes_crossing_hosts as planner_crossing
from torchpar.planner.plan import Plan
from torchpar.report import png
from torchpar.report.costs import shorten_modules
from torchpar.report.estimates import (
    axes_crossing_hosts,
    check_measured,
    method_title,
    plan_numbers,
)
from torchpar.report.html import render_html
from torchpar.report.operators import explain_strategy, merge_modules, parse_strategy
from torchpar.units import format_bytes, format_seconds

REL = 1e-12


@pytest.fixture(scope="module")
def pipeline_plan():
    """GPT-2 (2 blocks) with PipeshardParallel, stage_option="auto", on 2 hosts × 4 devices."""
    torchpar.init(cluster="local", num_hosts=2, devices_per_host=4)
    try:
        torch.manual_seed(0)
        model, batch = zoo.build("gpt2", {"n_layer": 2}, batch_size=8, seq_len=16)
        method = torchpar.PipeshardParallel(num_micro_batches=4, layer_option=torchpar.AutoLayerOption(layer_num=4))
        return torchpar.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch, method=method)
    finally:
        torchpar.init(cluster="local", num_devices=8)


@pytest.fixture(scope="module")
def shard_plan():
    """GPT-2 (2 blocks) with ShardParallel choosing its mesh on 8 devices, compared with the hand plans."""
    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", {"n_layer": 2}, batch_size=8, seq_len=16)
    return torchpar.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch,
                         method=torchpar.ShardParallel())


def _card(page: Page, attr: str):
    cards = [c for c in page.find("div", "card") if attr in c.attrs]
    assert len(cards) == 1, attr
    return cards[0]


def _assert_numbers_agree(plan: Plan, page: Page) -> None:
    """Header == stage table == the step the stage rows add up to == plan; bars and memory alike."""
    step = _card(page, "data-step-s")
    assert float(step.attrs["data-step-s"]) == pytest.approx(plan.estimated_step_s, rel=REL)
    assert format_seconds(plan.estimated_step_s) in step.content

    rows = page.rows("stages")
    assert len(rows) == len(plan.stages)
    costs = []
    for row, stage in zip(rows, plan.stages):
        for attr, value in (("data-cost-s", stage.estimated_cost_s), ("data-compute-s", stage.estimated_compute_s),
                            ("data-communication-s", stage.estimated_communication_s),
                            ("data-memory-bytes", stage.estimated_memory_bytes)):
            assert float(row.attrs[attr]) == pytest.approx(value, rel=REL), attr
        cells = [e.content for e in page.elements if e.tag == "td" and row in e.ancestors]
        assert format_seconds(stage.estimated_cost_s) in cells
        assert format_seconds(stage.estimated_compute_s) in cells
        assert format_bytes(stage.estimated_memory_bytes) in cells
        costs.append(float(row.attrs["data-cost-s"]))
    micro = plan.num_micro_batches if plan.method == "pipeshard" else 1
    from_rows = sum(costs) + (micro - 1) * max(costs)
    assert from_rows == pytest.approx(plan.estimated_step_s, rel=1e-9)
    total = next(e for e in page.find("tr", "total"))
    assert float(total.attrs["data-derived-step-s"]) == pytest.approx(plan.estimated_step_s, rel=1e-9)
    assert format_seconds(plan.estimated_step_s) in total.content

    memory = _card(page, "data-memory-bytes")
    peak = max(s.estimated_memory_bytes for s in plan.stages)
    assert float(memory.attrs["data-memory-bytes"]) == peak and format_bytes(peak) in memory.content
    bars = [b for b in page.find("div", "barrow") if "data-memory-bytes" in b.attrs]
    assert [float(b.attrs["data-memory-bytes"]) for b in bars] == [s.estimated_memory_bytes for s in plan.stages]
    assert all(format_bytes(s.estimated_memory_bytes) in b.content for b, s in zip(bars, plan.stages))
    time_bars = [b for b in page.find("div", "barrow") if "data-cost-s" in b.attrs]
    assert [float(b.attrs["data-cost-s"]) for b in time_bars] == [s.estimated_cost_s for s in plan.stages]
    for row, stage in zip(page.rows("memory"), plan.stages):
        assert float(row.attrs["data-memory-bytes"]) == stage.estimated_memory_bytes
        assert format_bytes(stage.estimated_memory_bytes) in row.content
    marker = [t.content for t in page.find("text", "estlabel")]
    assert marker == [f"estimated step {format_seconds(plan.estimated_step_s)}"]
    method = next(c for c in page.find("div", "card") if c.content.lower().startswith("method"))
    assert method.content == "method" + method_title(plan.method)  # "ShardParallel (shard)", never "auto"


def _png_texts(plan: Plan, **options) -> list[str]:
    fig = png.figure(plan, **options)
    try:
        return [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]
    finally:
        plt.close(fig)


def _assert_png_agrees(plan: Plan, **options) -> None:
    texts = _png_texts(plan, **options)
    title = plan_numbers(plan, options.get("measured")).headline
    assert title in texts and format_seconds(plan.estimated_step_s) in title
    assert format_bytes(max(s.estimated_memory_bytes for s in plan.stages)) in title
    assert method_title(plan.method) in title
    for index, stage in enumerate(plan.stages):
        label = next(t for t in texts if t.startswith(f"stage {index}: "))
        assert f"est. {format_seconds(stage.estimated_cost_s)}, {format_bytes(stage.estimated_memory_bytes)}" in label
    assert f"estimated step {format_seconds(plan.estimated_step_s)} " in texts


def test_pipeline_report_agrees(pipeline_plan, tmp_path):
    plan = pipeline_plan
    assert len(plan.stages) > 1 and plan.solver.get("runners_up")
    measured = {"step_s": 1.25 * plan.estimated_step_s,
                "memory_bytes": {i: 1.1 * s.estimated_memory_bytes for i, s in enumerate(plan.stages)}}
    page = Page(render_html(plan, measured=measured))
    _assert_numbers_agree(plan, page)

    # the runners-up table: the chosen plan first, same columns, each runner-up no better on the same model
    rows = page.rows("runners")
    assert rows[0].attrs["class"] == "chosen" and float(rows[0].attrs["data-step-s"]) == plan.estimated_step_s
    assert format_seconds(plan.estimated_step_s) in rows[0].content
    screening = plan.solver["stage_partition"]["estimated_step_s"]
    assert float(rows[0].attrs["data-screening-step-s"]) == pytest.approx(screening, rel=REL)
    assert len(rows) == 1 + len(plan.solver["runners_up"])
    for row, runner in zip(rows[1:], plan.solver["runners_up"]):
        if "error" in runner:
            continue
        if "step_at_least_s" in runner:  # its proven bound showed it could not win: shown as a bound
            assert f"≥ {format_seconds(runner['step_at_least_s'])}" in row.content
            assert runner["step_at_least_s"] >= plan.estimated_step_s
            continue
        assert float(row.attrs["data-step-s"]) >= plan.estimated_step_s
        assert float(row.attrs["data-step-s"]) == pytest.approx(runner["estimated_step_s"], rel=REL)
        assert float(row.attrs["data-screening-step-s"]) == pytest.approx(runner["screening_step_s"], rel=REL)
        assert format_seconds(runner["estimated_step_s"]) in row.content

    # measured figures sit beside the estimates
    assert float(_card(page, "data-measured-step-s").attrs["data-measured-step-s"]) == measured["step_s"]
    heads = [e.content for e in page.find("th") if e.inside("table", "stages")]
    assert "estimated" in heads and "measured" in heads and "peak memory" in heads
    for row, stage in zip(page.rows("stages"), plan.stages):
        assert float(row.attrs["data-measured-memory-bytes"]) == pytest.approx(1.1 * stage.estimated_memory_bytes)

    # cost constants, layers' modules, cross-host axes
    text = "".join(e.content for e in page.find("section") if e.attrs.get("id") == "constants")
    assert "2 × 4" in text and format_seconds(plan.cluster["inter_host_alpha"]) in text
    modules = [e.content for e in page.find("code", "module") if e.inside("table", "layers")]
    assert len(modules) == len(plan.layers) and any("transformer.h" in m for m in modules)

    _assert_png_agrees(plan, measured=measured)
    path = tmp_path / "pipeline.png"
    png.save_png(plan, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shard_report_explains_the_choice(shard_plan):
    plan = shard_plan
    assert plan.method == "shard" and len(plan.stages) == 1
    page = Page(render_html(plan))
    _assert_numbers_agree(plan, page)
    assert _card(page, "data-step-s") and "ShardParallel (shard)" in page.find("h1")[0].content

    # auto vs hand plans on the same cost model, the plan's own row highlighted and equal to the plan
    rows = page.rows("methods")
    assert {r.attrs["data-method"] for r in rows} == {"shard", "data_parallel", "zero2", "megatron"}
    own = next(r for r in rows if r.attrs["data-method"] == "shard")
    assert own.attrs["class"] == "chosen"
    assert float(own.attrs["data-step-s"]) == pytest.approx(plan.estimated_step_s, rel=REL)
    assert "Megatron" in page.find("table", "methods")[0].content
    meshes = page.rows("meshes")
    assert len(meshes) == len(plan.solver["mesh_shapes"]) > 1
    chosen = [r for r in meshes if r.attrs.get("class") == "chosen"]
    assert len(chosen) == 1 and float(chosen[0].attrs["data-step-s"]) == pytest.approx(plan.estimated_step_s)

    # the per-op strategies show where the batch is split, though the inputs are stored replicated
    stage = plan.stages[0]
    ops = page.rows("strategies")
    assert sum(int(r.attrs["data-ops"]) for r in ops) == len(stage.strategies)
    split = [r for r in ops if "batchsplit" in r.attrs.get("class", "")]
    assert split, "no anchor op splits the batch"
    note = page.find("p", "batchnote")[0].content
    assert "first split at" in note
    first = split[0].attrs["data-node"]
    assert parse_strategy(stage.strategies[first])[2] in note

    # memory by part and collective bytes
    parts = [e.content for e in page.find("th") if e.inside("table", "memory")]
    assert {"parameters", "gradients", "optimizer state", "activations"} <= set(parts)
    comm = page.rows("comm")
    assert float(comm[0].attrs["data-communication-bytes"]) == pytest.approx(sum(stage.communication_bytes.values()))

    _assert_png_agrees(plan)


def test_plan_saved_by_an_older_torchpar():
    """No breakdowns, no estimate note, runners-up with the stage DP's figure only: rendered, labelled."""
    stage = {"layers": [0], "submesh_shape": [1, 4], "logical_mesh_shape": [2, 2], "estimated_cost_s": 2e-3,
             "estimated_compute_s": 1.5e-3, "estimated_communication_s": 5e-4, "estimated_memory_bytes": 5 << 20,
             "params": {"w": [[0], [1]]}}
    plan = Plan.from_dict({
        "method": "pipeshard", "num_micro_batches": 2, "schedule": "1f1b", "estimated_step_s": 8e-3,
        "stages": [stage, {**stage, "layers": [1], "estimated_cost_s": 3e-3}],
        "solver": {"stage_partition": {"estimated_step_s": 0.0139, "stages": []},
                   "runners_up": [{"estimated_step_s": 0.0186, "stages": [stage]}]},
        "cluster": {"num_hosts": 2, "devices_per_host": 4}})
    page = Page(render_html(plan))
    _assert_numbers_agree(plan, page)
    rows = page.rows("runners")
    assert float(rows[0].attrs["data-step-s"]) == 8e-3 and "data-step-s" not in rows[1].attrs
    assert float(rows[1].attrs["data-screening-step-s"]) == 0.0186 and "not priced" in rows[1].content
    assert "older torchpar" in "".join(p.content for p in page.find("p", "note"))
    _assert_png_agrees(plan)


def test_measured_is_checked():
    plan = Plan.from_dict({"method": "shard", "estimated_step_s": 1e-3, "stages": [
        {"layers": [0], "submesh_shape": [1, 2], "logical_mesh_shape": [1, 2], "estimated_cost_s": 1e-3,
         "params": {}}]})
    assert check_measured({"step_s": 2e-3, "memory_bytes": {"0": 10}}, 1) == (2e-3, {0: 10.0})
    for bad, error in (({"step": 1}, "unknown key"), ({"step_s": -1}, "step_s"),
                       ({"memory_bytes": {3: 1}}, "stage 3"), ({"memory_bytes": {"x": 1}}, "stage indices")):
        with pytest.raises(ValueError, match=error):
            render_html(plan, measured=bad)
    with pytest.raises(TypeError, match="mapping"):
        render_html(plan, measured=[1.0])


def test_helpers():
    for submesh, logical in (((1, 8), (2, 4)), ((2, 4), (2, 4)), ((2, 4), (1, 8)), ((2, 4), (4, 2)), ((2, 4), (8, 1)),
                             ((4, 2), (2, 4)), ((2, 2), (4, 1))):
        assert axes_crossing_hosts(submesh, logical) == planner_crossing(submesh, logical), (submesh, logical)
    assert method_title("shard") == "ShardParallel (shard)" and method_title("single_device") == "single device"
    assert shorten_modules(["transformer", "transformer.wte", "transformer.wpe", "transformer.h.0",
                            "transformer.h.1", "transformer.h.2"]) == "transformer.{wte, wpe}, transformer.h.0–2"
    assert shorten_modules(["transformer.h.11", "transformer.ln_f", "lm_head"]) == \
        "transformer.h.11, transformer.ln_f, lm_head"
    assert merge_modules(["a.h.0.attn", "a.h.1.attn", "a.h.3.attn"]) == "a.h.0–1,3.attn"
    assert parse_strategy("aten.addmm.default transformer.h.0.attn.c_attn: m@0,n@1") == \
        ("addmm", "transformer.h.0.attn.c_attn", "m@0,n@1")
    assert explain_strategy("addmm", "m@0,n@1") == "rows (batch × sequence) over axis 0; out features over axis 1"
    assert explain_strategy("embedding", "a@01") == "index dim 0 (batch) over axes 0 and 1"
