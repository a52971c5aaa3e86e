"""``PipeshardParallel(num_micro_batches="auto")``: the counts tried, the scan and its bound, and the plan it gives
against plans made at each count directly (``torchpar.plan``, meta GPT-2 on 8 devices)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import torchpar
from torchpar.planner.pipeline.micro_batch_counts import PATIENCE, candidate_counts, search_counts
from torchpar.planner.remat_choice import NoFasterPlan


def test_candidate_counts_are_the_powers_of_two_dividing_the_rows_and_the_rows():
    assert candidate_counts(16) == [16, 8, 4, 2, 1]
    assert candidate_counts(12) == [12, 4, 2, 1]
    assert candidate_counts(1536) == [1536, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert candidate_counts(1) == [1]
    with pytest.raises(ValueError, match="0 rows"):
        candidate_counts(0)


def _planner(steps: dict[int, float | str]):
    """A ``plan_at`` over a table: a step (pruned when no less than the bound), or an error's text."""
    calls: list[tuple[int, float]] = []

    def plan_at(count: int, beat_s: float) -> float:
        calls.append((count, beat_s))
        step = steps[count]
        if isinstance(step, str):
            raise ValueError(step)
        if step >= beat_s:
            raise NoFasterPlan(step, beat_s)
        return step

    return plan_at, calls


def test_the_scan_keeps_the_least_step_and_bounds_each_count_by_the_best_so_far():
    steps = {64: "no sharding plan fits the memory budget", 32: 5.0, 16: 3.0, 8: 3.5, 4: 4.0, 2: 1.0, 1: 9.0}
    plan_at, calls = _planner(steps)
    count, step, rows = search_counts([64, 32, 16, 8, 4, 2, 1], plan_at, lambda s: s)
    # a miss before any plan does not count toward the patience; two misses after the best (8, 4) stop the scan, so
    # the better 2 is never tried: a search, not a proof
    assert (count, step) == (16, 3.0) and PATIENCE == 2
    assert calls == [(64, math.inf), (32, math.inf), (16, 5.0), (8, 3.0), (4, 3.0)]
    assert [(r["count"], r["outcome"]) for r in rows] == [(64, "does not fit"), (32, "planned"), (16, "planned"),
                                                         (8, "pruned"), (4, "pruned")]
    assert rows[0]["error"] == "no sharding plan fits the memory budget" and rows[3]["step_at_least_s"] == 3.5


def test_a_tie_goes_to_the_count_tried_first_and_a_later_best_resets_the_patience():
    plan_at, _ = _planner({8: 2.0, 4: 2.0, 2: 1.5, 1: 3.0})
    count, _, rows = search_counts([8, 4, 2, 1], plan_at, lambda s: s)
    assert count == 2 and [r["outcome"] for r in rows] == ["planned", "pruned", "planned", "pruned"]


def test_no_count_that_fits_is_an_error_listing_each_count():
    plan_at, _ = _planner({4: "needs 20 GiB", 2: "needs 30 GiB"})
    with pytest.raises(ValueError, match=r"(?s)4 micro-batches: needs 20 GiB.*2 micro-batches: needs 30 GiB"):
        search_counts([4, 2], plan_at, lambda s: s)


@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    torchpar.init(cluster="local", num_devices=8)


def _plan(num_micro_batches, **options):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=512,
                                                                     n_positions=64))
        ids = torch.randint(0, 512, (4, 64))
    method = torchpar.PipeshardParallel(num_micro_batches=num_micro_batches,
                                        layer_option=torchpar.AutoLayerOption(layer_num=4))
    return torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch={"input_ids": ids, "labels": ids},
                         method=method, explain=False, **options)


def test_auto_micro_batches_plan_as_the_best_count_planned_directly():
    searched = _plan("auto")
    record = searched.solver["micro_batches"]
    assert record["rows"] == 4 and [row["count"] for row in record["tried"]] == [4, 2, 1]
    direct = {count: _plan(count) for count in (4, 2, 1)}
    best = min(direct, key=lambda c: (direct[c].estimated_step_s, -c))  # ties: the scan tries more micro-batches first
    assert searched.num_micro_batches == record["chosen"] == best
    assert searched.estimated_step_s == pytest.approx(direct[best].estimated_step_s, rel=1e-9)
    assert [s.layers for s in searched.stages] == [s.layers for s in direct[best].stages]
    for row in record["tried"]:  # every count lost to the chosen one by its own plan or its proven bound
        step = row.get("estimated_step_s", row.get("step_at_least_s"))
        assert step >= searched.estimated_step_s * (1 - 1e-9)
        assert direct[row["count"]].estimated_step_s >= searched.estimated_step_s * (1 - 1e-9)
    assert "micro_batch_search" in searched.timings


def test_a_pipeline_that_cannot_beat_a_bound_says_so_for_every_remat_option():
    """``beat_s`` reaches the stage DP's candidates (``remat`` fixed) and every option of ``remat="auto"``."""
    from torchpar.planner.remat_choice import NoFasterPlan as Slower

    with pytest.raises(Slower):
        _plan_with_bound(1e-9, remat="auto")
    with pytest.raises(Slower):
        _plan_with_bound(1e-9, remat="none")
    assert _plan_with_bound(math.inf, remat="none").estimated_step_s == pytest.approx(
        _plan(2).estimated_step_s, rel=1e-9)


def _plan_with_bound(beat_s: float, remat: str):
    """``_plan(2)``'s pipeline planned through ``plan_with`` in ``torchpar.api.plan`` with a bound: the planner's
    entry (``plan_training_profiled``) called as the count search calls it."""
    from torchpar.capture.export import capture_train_step
    from torchpar.capture.semantics.grad_semantics import trainable_params
    from torchpar.capture.optimizer import TorchOptimizerBridge
    from torchpar.cluster import current_cluster
    from torchpar.options import numerics_for
    from torchpar.engine.profiled import plan_training_profiled

    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=512,
                                                                     n_positions=64))
        ids = torch.randint(0, 512, (2, 64))
    names = dict(model.named_parameters())
    spec = TorchOptimizerBridge(torch.optim.AdamW(model.parameters()), {id(p): n for n, p in names.items()}).spec
    capture = capture_train_step(model, {"input_ids": ids, "labels": ids}, None)
    method = torchpar.PipeshardParallel(num_micro_batches=2, layer_option=torchpar.AutoLayerOption(layer_num=4))
    return plan_training_profiled(capture.graph, method, current_cluster(), profile=False, spec=spec,
                                  trainable=set(trainable_params(capture.graph, names, spec.param_names)), remat=remat,
                                  numerics=numerics_for(None), library_fusions=True, beat_s=beat_s).plan


def test_the_summary_and_the_plan_command_show_the_counts_tried(tmp_path, capsys):
    from torchpar.__main__ import main
    from torchpar.planner.plan import Plan

    try:
        code = main(["plan", "--meta", "--model", "gpt2", "--config", '{"n_layer": 2, "n_embd": 64, "n_head": 4}',
                     "--batch-size", "4", "--seq-len", "32", "--devices", "8", "--method", "pipeshard",
                     "--micro-batches", "auto", "--layers", "2", "--json", str(tmp_path / "p.json"),
                     "--out", str(tmp_path / "p.html")])
    finally:
        torchpar.init(cluster="local", num_devices=8)
    out = capsys.readouterr().out
    assert code == 0, out
    plan = Plan.from_json((tmp_path / "p.json").read_text())
    record = plan.solver["micro_batches"]
    assert plan.num_micro_batches == record["chosen"] and record["tried"][0]["count"] == 4
    assert f"micro-batches: auto → {plan.num_micro_batches} of {4 // plan.num_micro_batches} row(s)" in out
    with pytest.raises(SystemExit):
        main(["plan", "--meta", "--model", "gpt2", "--method", "pipeshard", "--micro-batches", "0"])
    assert "expected a positive int or 'auto', got 0" in capsys.readouterr().err
