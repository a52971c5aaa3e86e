"""The measured pipeline step (``engine.last_timeline``): compute blocks and non-compute spans, and the
per-stage breakdown that sums to the step's wall time; and the stage forward's residuals (parameters passed
back, not copied; transposes recomputed) leaving the losses bit for bit as they were. Nothing here is timed."""

from __future__ import annotations

import pytest
import torch

import torchpar
from torchpar.runtime.pipeline import stage_program
from torchpar.runtime.pipeline.timeline import BREAKDOWN_KEYS, SPAN_KINDS, StepTimeline

M = 4


def test_breakdown_parts_sum_to_the_makespan():
    blocks = [[("forward", 0, 1.0, 2.0), ("backward", 0, 4.0, 6.0)],
              [("forward", 0, 2.5, 3.5), ("backward", 0, 3.5, 4.0)]]
    spans = [[("dispatch", 0, 0.5, 1.0), ("send", 0, 2.0, 2.25), ("recv_wait", 0, 2.5, 3.75), ("recv_copy", 0, 3.75, 4.0)],
             [("recv_wait", 0, 2.0, 2.5), ("send", 0, 4.0, 4.5)]]
    timeline = StepTimeline(blocks=blocks, makespan=7.0, spans=spans)
    first, second = timeline.breakdown()
    assert first == {"launch": 0.5, "compute": 3.0, "dispatch": 0.5, "input": 0.0, "send": 0.25, "recv_wait": 1.25,
                     "recv_copy": 0.25, "interpreter": 0.25, "tail": 1.0}
    assert second["launch"] == 2.0 and second["tail"] == 2.5 and second["interpreter"] == 0.0
    for parts in (first, second):
        assert list(parts) == list(BREAKDOWN_KEYS)
        assert sum(parts.values()) == pytest.approx(7.0)


def test_a_stage_without_blocks_is_all_launch():
    timeline = StepTimeline(blocks=[[("forward", 0, 0.0, 1.0)], []], makespan=2.0)
    assert timeline.breakdown()[1]["launch"] == 2.0
    assert timeline.breakdown()[0]["tail"] == 1.0


class TwoStageMLP(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x, y):
        for index, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if index == 1:
                x = torchpar.mark_pipeline_boundary(x)
        return torch.nn.functional.mse_loss(x, y)


def _engine():
    torch.manual_seed(0)
    model = TwoStageMLP()
    batch = (torch.randn(16, 16), torch.randn(16, 16))
    option = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)), submesh_physical_shapes=((1, 4),) * 2,
                                        submesh_logical_shapes=((4, 1),) * 2)  # the 8 test devices, data parallel
    method = torchpar.PipeshardParallel(num_micro_batches=M, layer_option="manual", stage_option=option)
    return torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch, method=method), batch


def test_a_pipeline_step_records_every_stage_s_spans():
    engine, batch = _engine()
    try:
        engine.step(batch)
        timeline = engine.last_timeline
        assert len(timeline.blocks) == len(timeline.spans) == 2
        for stage, (blocks, spans) in enumerate(zip(timeline.blocks, timeline.spans)):
            assert sorted(mb for op, mb, _, _ in blocks if op == "forward") == list(range(M))
            kinds = {kind for kind, *_ in spans}
            assert kinds <= set(SPAN_KINDS) and "dispatch" in kinds
            assert ("recv_wait" in kinds) and ("send" in kinds)  # stage 0 receives gradients, stage 1 activations
            for kind, _, start, end in spans:  # one thread: no span overlaps a compute block
                assert all(end <= b_start or start >= b_end for _, _, b_start, b_end in blocks), kind
        for parts in timeline.breakdown():
            assert min(parts.values()) >= 0
            assert sum(parts.values()) == pytest.approx(timeline.makespan)
    finally:
        engine.shutdown()


def test_forward_residuals_pass_the_parameters_back_and_keep_the_losses_exact(monkeypatch):
    import jax

    engine, batch = _engine()
    try:
        losses = [engine.step(batch).item() for _ in range(3)]
        worker = engine.executor.worker
        program, state = worker.programs[1], worker.states[1]
        acts = {n: program.put_activation(n, torch.zeros(4, 16).numpy()) for n in program.stage.activation_inputs}
        inputs = {i: program.put_input(i, batch[i][:4].numpy()) for i in program.stage.batch_inputs}
        *_, residuals = program.forward(state.params, state.buffers, inputs, acts, jax.random.key(0))
        leaves = [id(leaf) for leaf in jax.tree.leaves(residuals)]
        weights = [n for n in state.params if n.endswith("weight")]
        assert weights and all(id(state.params[n]) in leaves for n in weights)  # the weights themselves, no copies
    finally:
        engine.shutdown()
    monkeypatch.setattr(stage_program, "_RECOMPUTED", frozenset())  # save every intermediate, as before
    engine, batch = _engine()
    try:
        assert [engine.step(batch).item() for _ in range(3)] == losses
    finally:
        engine.shutdown()
