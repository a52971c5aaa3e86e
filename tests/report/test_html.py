"""The HTML and PNG plan reports: parsed with the standard library's html.parser and checked for the device
grid, the stage and parameter tables, the timeline's blocks, escaping and self-containment; rendered with
headless Chromium when it is installed."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

import torchpar
from tests.report.html_page import Page
from torchpar.cluster import ClusterSpec
from torchpar.harness import zoo
from torchpar.planner.plan import Plan
from torchpar.report.html import render_html
from torchpar.report.layout import device_grid, stage_color, timeline_view

CHROMIUM = "/usr/bin/chromium"
EVIL = "<script>alert('x')</script>&"


def _hand_plan(num_micro_batches: int = 4) -> Plan:
    """Two stages on 2 hosts × 4 devices: (1,4) with a 1×4 mesh, then (1,4) with a 2×2 mesh."""
    stage = dict(estimated_compute_s=2e-3, estimated_communication_s=1e-3, estimated_memory_bytes=3 << 20)
    return Plan.from_dict({
        "method": "pipeshard", "num_micro_batches": num_micro_batches, "schedule": "1f1b",
        "estimated_step_s": 7e-3 + (num_micro_batches - 1) * 4e-3,
        "stages": [
            {**stage, "layers": [0, 1], "submesh_shape": [1, 4], "logical_mesh_shape": [1, 4], "estimated_cost_s": 3e-3,
             "params": {"embed.weight": [None, [1]], "block0.weight": [[1], None], EVIL: [None]}},
            {**stage, "layers": [2, 3], "submesh_shape": [1, 4], "logical_mesh_shape": [2, 2], "estimated_cost_s": 4e-3,
             "params": {"block1.weight": [[0], [1]], "head.weight": [[0, 1], None], "head.bias": [None]},
             "optimizer_state": {"head.bias": [[0]]}},
        ],
        "solver": {"stage0": {"status": "OPTIMAL", "solve_s": 0.1}, "stage1": {"status": "FEASIBLE", "gap": 0.01},
                   "runners_up": [{"estimated_step_s": 0.03,
                                   "stages": [{"layers": [0, 1, 2, 3], "submesh_shape": [2, 4],
                                               "logical_mesh_shape": [1, 8], "estimated_cost_s": 0.007}]}]},
        "timings": {"capture": 1.5, "cluster": 0.01, "stage_dp": 0.2, "ilp": 0.7},
    })


@pytest.fixture(scope="module")
def gpt2():
    """A real ShardParallel plan of a 1-block GPT-2 on the session's 1 host × 8 devices, and its shapes."""
    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", {"n_layer": 1}, batch_size=8, seq_len=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = torchpar.plan(model, optimizer, example_batch=batch, method=torchpar.ShardParallel(mesh_shape=(1, 8)))
    return plan, {n: list(p.shape) for n, p in model.named_parameters()}


@pytest.fixture
def two_hosts():
    torchpar.init(cluster="local", num_hosts=2, devices_per_host=4)
    yield
    torchpar.init(cluster="local", num_devices=8)


def _screenshot(html, tmp_path):
    """Render ``html`` with headless Chromium; returns the PNG path (asserting it was written)."""
    shot = tmp_path / "shot.png"
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run",
               f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,2400",
               html.resolve().as_uri()]
    subprocess.run(command, check=False, capture_output=True, timeout=120)
    assert shot.exists(), "Chromium wrote no screenshot"
    return shot


def _assert_self_contained(page: Page, text: str) -> None:
    for element in page.elements:
        for name in ("src", "href", "xlink:href", "action", "data"):
            value = element.attrs.get(name, "")
            assert "http" not in value and not value.startswith("//"), (element.tag, name, value)
    assert not page.find("link") and not any("src" in s.attrs for s in page.find("script"))
    assert "@import" not in text and "url(" not in text


def test_sharded_gpt2_report(gpt2, tmp_path):
    plan, shapes = gpt2
    path = tmp_path / "plan.html"
    plan.save_html(path, param_shapes=shapes)
    text = path.read_text(encoding="utf-8")
    page = Page(text)
    _assert_self_contained(page, text)

    cells = page.find("div", "device")
    assert len(cells) == 8
    used = [c for c in cells if "data-stage" in c.attrs]
    assert len(used) == plan.stages[0].submesh_shape[0] * plan.stages[0].submesh_shape[1]
    assert all(f"background:{stage_color(0)}" in c.attrs["style"] for c in used)

    assert len(page.rows("stages")) == 1
    rows = page.rows("params")
    assert len(rows) == len(plan.stages[0].params) == len(shapes)
    names = {e.content for e in page.find("code") if e.inside("table", "params")}
    assert names == set(shapes)
    wte = next(r for r in rows if "transformer.wte.weight" in r.content)
    assert "×".join(map(str, shapes["transformer.wte.weight"])) in wte.content

    assert len(page.find("rect", "fwd")) == len(page.find("rect", "bwd")) == 1  # one stage, one micro-batch
    assert "sortable" in page.find("table", "params")[0].classes
    assert "OPTIMAL" in text and "capture" in text
    measured = render_html(plan, timeline=[[("step", 0, 100.0, 100.01)]], param_shapes=shapes)
    assert "bubble (" not in text and "bubble (" not in measured  # one stage: no bubble card, estimated or measured


def test_two_stage_plan_on_two_hosts(two_hosts, tmp_path):
    plan = _hand_plan(num_micro_batches=4)
    path = tmp_path / "plan.html"
    plan.save_html(path)
    text = path.read_text(encoding="utf-8")
    page = Page(text)
    _assert_self_contained(page, text)

    cells = page.find("div", "device")
    assert len(cells) == 8
    stage_of = {int(c.attrs["data-device"]): int(c.attrs["data-stage"]) for c in cells}
    assert stage_of == {d: d // 4 for d in range(8)}  # stage 0 on host 0, stage 1 on host 1
    for cell in cells:
        assert f"background:{stage_color(int(cell.attrs['data-stage']))}" in cell.attrs["style"]
    assert len(page.find("div", "host")) == 2

    assert len(page.rows("stages")) == 2
    assert len(page.rows("params")) == sum(len(s.params) for s in plan.stages)

    for op in ("fwd", "bwd"):
        blocks = page.find("rect", op)
        assert len(blocks) == 2 * 4
        for stage in (0, 1):
            assert sorted(int(b.attrs["data-micro-batch"]) for b in blocks if b.attrs["data-stage"] == str(stage)) \
                == [0, 1, 2, 3]

    # every text is escaped: the odd parameter name shows as text, never as markup
    assert EVIL not in text
    assert not [s for s in page.find("script") if "alert" in s.content]
    assert any(EVIL in e.content for e in page.find("code"))
    assert "optimizer state: S0" in text
    assert "Runners-up" in text


def test_grid_and_timeline_layout():
    plan = _hand_plan(num_micro_batches=3)
    grid = device_grid(plan, ClusterSpec(num_hosts=2, devices_per_host=4))
    assert grid.stage_devices == ((0, 1, 2, 3), (4, 5, 6, 7))
    coords = {c.device: c.mesh_coord for c in grid.cells}
    assert coords[4] == (0, 0) and coords[7] == (1, 1)  # stage 1's 2×2 mesh

    view = timeline_view(plan)  # estimated: forward ⅓, backward ⅔ of each stage's cost
    assert view.source == "estimated"
    assert [sum(b[0] == "forward" for b in s) for s in view.blocks] == [3, 3]
    forward = next(b for b in view.blocks[1] if b[0] == "forward")
    assert forward[3] - forward[2] == pytest.approx(4e-3 / 3)

    # a plan for more devices than the current cluster: the grid is inferred from the submeshes
    inferred = device_grid(plan, ClusterSpec(num_hosts=1, devices_per_host=1))
    assert (inferred.num_hosts, inferred.devices_per_host) == (2, 4) and inferred.notes


def test_measured_timeline(tmp_path):
    plan = _hand_plan(num_micro_batches=2)
    t0 = 100.0
    measured = [[("forward", 0, t0, t0 + 1e-3), ("forward", 1, t0 + 1e-3, t0 + 2e-3),
                 ("backward", 0, t0 + 5e-3, t0 + 7e-3), ("backward", 1, t0 + 7e-3, t0 + 9e-3)],
                [("forward", 0, t0 + 1e-3, t0 + 2e-3), ("backward", 0, t0 + 2e-3, t0 + 4e-3),
                 ("forward", 1, t0 + 4e-3, t0 + 5e-3), ("backward", 1, t0 + 5e-3, t0 + 7e-3)]]
    view = timeline_view(plan, measured)
    assert view.source == "measured" and view.makespan == pytest.approx(9e-3)
    page = Page(render_html(plan, timeline=measured, cluster=ClusterSpec(num_hosts=2, devices_per_host=4)))
    assert len(page.find("rect", "fwd")) == len(page.find("rect", "bwd")) == 4
    heads = [e.content for e in page.find("th") if e.inside("table", "stages")]
    assert "measured" in heads and "F+B time" in heads
    rows = page.rows("stages")
    assert [float(r.attrs["data-measured-time-s"]) for r in rows] == pytest.approx([3e-3, 3e-3])
    with pytest.raises(ValueError, match="stage"):
        timeline_view(plan, measured[:1])
    # a stage nothing was timed on reads n/a, not "0 s" and "0.00×"
    page = Page(render_html(plan, timeline=[measured[0], []], cluster=ClusterSpec(num_hosts=2, devices_per_host=4)))
    rows = page.rows("stages")
    assert "data-measured-time-s" not in rows[1].attrs and "n/a" in rows[1].text and "0.00×" not in rows[1].text


def test_save_png(gpt2, tmp_path):
    plan, _ = gpt2
    for name, p in (("shard.png", plan), ("pipe.png", _hand_plan())):
        path = tmp_path / name
        p.save_png(path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed (apt-get install chromium)")
def test_chromium_renders_the_page(tmp_path):
    html = tmp_path / "plan.html"
    _hand_plan().save_html(html, cluster=ClusterSpec(num_hosts=2, devices_per_host=4))
    shot = _screenshot(html, tmp_path)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed (apt-get install chromium)")
def test_parameter_table_sorts_on_header_click(tmp_path):
    """The inline JS: a click on "parameter" sorts by name, a second click reverses, "rank" sorts numerically."""
    html = render_html(_hand_plan(), cluster=ClusterSpec(num_hosts=2, devices_per_host=4))
    probe = """<script>
      var table = document.querySelector("table.params"), heads = table.querySelectorAll("th");
      function column(i) { return Array.prototype.map.call(table.tBodies[0].rows, function (r) {
        return r.cells[i].textContent; }); }
      heads[1].click(); var up = column(1); heads[1].click(); var down = column(1); heads[2].click();
      document.body.setAttribute("data-probe", JSON.stringify({up: up, down: down, rank: column(2)}));
    </script></body>"""
    page = tmp_path / "probe.html"
    page.write_text(html.replace("</body>", probe), encoding="utf-8")
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--disable-sync", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.resolve().as_uri()],
                         check=False, capture_output=True, text=True, timeout=120).stdout
    body = next(e for e in Page(dom).elements if e.tag == "body")
    result = json.loads(body.attrs["data-probe"])
    names = [n for s in _hand_plan().stages for n in s.params]
    assert result["up"] == sorted(names, key=str.lower) or result["up"] == sorted(names)
    assert result["down"] == result["up"][::-1]
    assert result["rank"] == sorted(result["rank"], key=int)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed (apt-get install chromium)")
def test_tables_fit_a_1280_pixel_window(tmp_path):
    """No table, the stage table with its measured columns included, scrolls sideways at 1280 px."""
    plan = _hand_plan(num_micro_batches=2)
    t0 = 0.0
    timeline = [[("forward", m, t0 + m, t0 + m + 1e-3) for m in range(2)] + [("backward", m, 3 + m, 3.002 + m)
                                                                             for m in range(2)]] * 2
    html = render_html(plan, timeline=timeline, measured={"step_s": 0.021, "memory_bytes": {0: 3.3e6, 1: 3.1e6}},
                       cluster=ClusterSpec(num_hosts=2, devices_per_host=4),
                       param_shapes={n: [1024] * len(s) for st in plan.stages for n, s in st.params.items()})
    probe = """<script>
      var wide = [];
      document.querySelectorAll(".tablewrap").forEach(function (w) {
        if (w.scrollWidth > w.clientWidth + 1) { wide.push(w.querySelector("table").className); } });
      if (document.documentElement.scrollWidth > window.innerWidth) { wide.push("page"); }
      document.body.setAttribute("data-probe", JSON.stringify(wide));
    </script></body>"""
    page = tmp_path / "probe.html"
    page.write_text(html.replace("</body>", probe), encoding="utf-8")
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,900",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.resolve().as_uri()],
                         check=False, capture_output=True, text=True, timeout=120).stdout
    body = next(e for e in Page(dom).elements if e.tag == "body")
    assert json.loads(body.attrs["data-probe"]) == []
    assert "measured" in [e.content for e in Page(html).find("th") if e.inside("table", "stages")]


def test_gpt2_12_layer_pipeshard_report_on_two_hosts(two_hosts, tmp_path):
    """The acceptance case: GPT-2 with 12 layers on 2 hosts × 4 devices with PipeshardParallel."""
    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", {"n_layer": 12}, batch_size=8, seq_len=16)
    method = torchpar.PipeshardParallel(num_micro_batches=4, layer_option=torchpar.AutoLayerOption(layer_num=4),
                                        stage_option="uniform")
    plan = torchpar.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch, method=method)
    stages, micro = len(plan.stages), plan.num_micro_batches
    assert stages > 1
    path = tmp_path / "gpt2.html"
    plan.save_html(path, param_shapes={n: list(p.shape) for n, p in model.named_parameters()})
    plan.save_png(tmp_path / "gpt2.png")
    text = path.read_text(encoding="utf-8")
    page = Page(text)
    _assert_self_contained(page, text)
    cells = page.find("div", "device")
    assert len(cells) == 8 and len({c.attrs["data-stage"] for c in cells}) == stages
    assert len(page.rows("stages")) == stages
    assert len(page.rows("params")) == sum(len(s.params) for s in plan.stages)
    assert len(page.find("rect", "fwd")) == len(page.find("rect", "bwd")) == stages * micro
    assert (tmp_path / "gpt2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.path.exists(CHROMIUM):
        assert _screenshot(path, tmp_path).stat().st_size > 10_000
