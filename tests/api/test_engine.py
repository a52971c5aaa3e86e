"""Engine behaviour on small hand-written models: calling conventions, losses, buffers, frozen and
unused parameters, gradient clipping, plan and HLO, and the errors a user can cause."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import torchpar
from torchpar.planner.plan import Plan

LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6


class TinyNet(torch.nn.Module):
    """Linear → BatchNorm → ReLU → Linear with an MSE loss; has running-stat buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, bias=False)  # a bias before BatchNorm has zero gradient
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(4, 4)  # never called: gets no gradient, must not move

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.bn(self.fc1(x)))), y)


def _train_both(model, batch, make_opt, steps=5, **compile_kwargs):
    reference = copy.deepcopy(model)
    ref_opt = make_opt(reference)
    engine = torchpar.compile(model, make_opt(model), example_batch=batch, **compile_kwargs)
    torch_losses, ours = [], []
    for _ in range(steps):
        ref_opt.zero_grad()
        loss = reference(*batch) if isinstance(batch, tuple) else reference(batch)
        loss.backward()
        if compile_kwargs.get("grad_clip_norm"):
            torch.nn.utils.clip_grad_norm_(reference.parameters(), compile_kwargs["grad_clip_norm"])
        ref_opt.step()
        torch_losses.append(loss.item())
        ours.append(engine.step(batch).item())
    engine.sync_to_torch()
    return reference, engine, torch_losses, ours


def test_tuple_batch_buffers_and_unused_params_match_torch():
    torch.manual_seed(0)
    model = TinyNet()
    batch = (torch.randn(32, 8), torch.randn(32, 4))
    unused_before = model.unused.weight.detach().clone()
    reference, engine, torch_losses, ours = _train_both(
        model, batch, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    torch.testing.assert_close(ours, torch_losses, rtol=LOSS_RTOL, atol=0)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
    for (name, b), c in zip(reference.named_buffers(), model.buffers()):
        torch.testing.assert_close(c, b, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
    assert model.bn.num_batches_tracked.item() == 5
    torch.testing.assert_close(model.unused.weight, unused_before, rtol=0, atol=0)


def test_tensor_batch_with_loss_fn_and_frozen_param():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model[0].bias.requires_grad_(False)
    frozen = model[0].bias.detach().clone()
    x = torch.randn(10, 6)
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=x,
                              loss_fn=lambda out, batch: (out ** 2).mean() + batch.sum() * 0)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        ref_opt.zero_grad()
        loss = (reference(x) ** 2).mean()
        loss.backward()
        ref_opt.step()
        assert engine.step(x) == pytest.approx(loss.item(), rel=LOSS_RTOL)
    engine.sync_to_torch()
    torch.testing.assert_close(model[0].bias, frozen, rtol=0, atol=0)
    torch.testing.assert_close(model[2].weight, reference[2].weight, rtol=PARAM_RTOL, atol=PARAM_ATOL)


def test_grad_clipping_matches_clip_grad_norm():
    torch.manual_seed(0)
    model = TinyNet()
    batch = (torch.randn(16, 8) * 10, torch.randn(16, 4))
    reference, _, torch_losses, ours = _train_both(
        model, batch, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), grad_clip_norm=0.5)
    torch.testing.assert_close(ours, torch_losses, rtol=LOSS_RTOL, atol=0)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


def test_plan_and_hlo_for_one_device():
    torch.manual_seed(0)
    model = TinyNet()
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch)
    engine.step(batch)
    plan = engine.plan
    data = plan.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert Plan.from_dict(data).to_dict() == data
    (stage,) = data["stages"]
    assert stage["submesh_shape"] == [1, 1] and stage["logical_mesh_shape"] == [1, 1]
    assert stage["params"]["fc1.weight"] == [None, None]
    assert set(data["timings"]) >= {"capture", "lower", "xla_compile"}
    assert "fc1.weight" in plan.summary()
    (hlo,) = engine.hlo_text()
    assert hlo.startswith("HloModule") and "dot(" in hlo


@pytest.mark.parametrize("method", [None, torchpar.Zero3Parallel(), torchpar.MegatronParallel()],
                         ids=["single_device", "zero3", "megatron"])
def test_memory_stats_of_a_one_stage_plan_are_stage_0(method):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    batch = torch.randn(16, 16)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                          loss_fn=lambda out, _: out.square().mean(), method=method) as engine:
        engine.step(batch)
        stats = engine.memory_stats()
        assert isinstance(stats, dict) and list(stats) == [0]
        assert set(stats[0]) == {f"{f}_bytes" for f in ("argument", "output", "alias", "temp", "generated_code")}
        param_bytes = sum(p.numel() * 4 for p in model.parameters())
        assert stats[0]["argument_bytes"] >= param_bytes // 8  # the state enters the step (sharded at most 8 ways)


def test_the_report_shows_what_the_engine_measured_beside_the_estimates(tmp_path):
    """``engine.save_report`` puts the last step's wall time and each stage's XLA memory next to the plan's
    estimates (pipelines: the last step's timeline too)."""
    import re

    from torchpar.runtime.resources import executable_peak_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    batch = torch.randn(16, 16)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                          loss_fn=lambda out, _: out.square().mean(), method=torchpar.DataParallel()) as engine:
        assert engine.measured()["step_s"] is None
        engine.step(batch)
        measured = engine.measured()
        assert 0 < measured["step_s"] < 60
        stats = engine.memory_stats()[0]
        assert measured["memory_bytes"] == {0: executable_peak_bytes(stats)}
        assert measured["memory_bytes"][0] == (stats["argument_bytes"] + stats["output_bytes"] - stats["alias_bytes"]
                                               + stats["temp_bytes"])
        page = engine.save_report(tmp_path / "report.html").read_text(encoding="utf-8")
    shown = re.search(r"data-measured-step-s=['\"]([^'\"]+)", page)
    assert shown and float(shown.group(1)) == measured["step_s"]
    memory = re.search(r"data-measured-memory-bytes=['\"]([^'\"]+)", page)
    assert memory and float(memory.group(1)) == measured["memory_bytes"][0]


def test_mark_pipeline_boundary_is_identity_in_both_worlds():
    class Marked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.b(torchpar.mark_pipeline_boundary(torch.relu(self.a(x)))).sum()

    torch.manual_seed(0)
    model = Marked()
    x = torch.randn(3, 4)
    eager = model(x)
    eager.backward()  # differentiable in PyTorch too
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.0), example_batch=x)
    assert "torchpar.pipeline_boundary" in engine.graph.op_counts()
    assert engine.step(x) == pytest.approx(eager.item(), rel=1e-6)


def test_hf_gradient_checkpointing_is_refused_with_a_warning_and_the_step_still_matches():
    import transformers

    from torchpar.capture.semantics.remat import GradientCheckpointingIgnoredWarning, checkpointing_modules

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    model.gradient_checkpointing_enable()  # torch.utils.checkpoint in train mode: capture must go through it
    ids = torch.randint(0, 64, (4, 16))
    batch = {"input_ids": ids, "labels": ids}
    with pytest.warns(GradientCheckpointingIgnoredWarning) as record:
        engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch)
    (warning,) = [w for w in record if w.category is GradientCheckpointingIgnoredWarning]
    message = str(warning.message)
    for words in ("does not apply HF gradient checkpointing", "keeps every activation", "num_micro_batches",
                  "Zero3Parallel", "remat='layers'", "gradient_checkpointing_disable()"):
        assert words in message
    assert not [w for w in record if "is_gradient_checkpointing" in str(w.message)]  # transformers' FutureWarning
    assert warning.filename == __file__  # points at the user's call
    with engine:
        assert engine.step(batch) == pytest.approx(reference(**batch).loss.item(), rel=LOSS_RTOL)
    model.gradient_checkpointing_disable()
    assert checkpointing_modules(model) == []


def test_reading_an_hf_models_checkpointing_flag_raises_no_future_warning():
    import warnings

    import transformers

    from torchpar.capture.semantics.remat import checkpointing_modules

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                                                 n_positions=16))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert checkpointing_modules(model) == []
    assert [str(w.message) for w in record] == []


def test_gradient_checkpointing_flag_of_any_submodule_is_detected():
    from torchpar.capture.semantics.remat import checkpointing_modules

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert checkpointing_modules(model) == []
    model[1].gradient_checkpointing = True
    assert checkpointing_modules(model) == ["1"]


def test_compile_has_an_explicit_documented_signature():
    import dataclasses
    import inspect
    from pathlib import Path

    from torchpar import api
    public = inspect.signature(torchpar.compile).parameters
    core = inspect.signature(api.compile).parameters
    assert list(public) == list(core)  # the same options, in the same order, with the same defaults
    assert {f.name for f in dataclasses.fields(api.CompileOptions)} <= set(public)
    heading = next(line for line in (Path(__file__).parents[2] / "docs" / "api.md").read_text().splitlines()
                   if line.startswith("## `torchpar.compile("))
    for name, parameter in public.items():
        assert parameter.kind is (inspect.Parameter.POSITIONAL_OR_KEYWORD if name in ("model", "optimizer")
                                  else inspect.Parameter.KEYWORD_ONLY), name
        assert parameter.default == core[name].default and parameter.annotation is not inspect.Parameter.empty, name
        assert f"``{name}``" in torchpar.compile.__doc__, name
        default = "" if parameter.default is inspect.Parameter.empty else "=" + (
            f'"{parameter.default}"' if isinstance(parameter.default, str) else str(parameter.default))
        assert f"{name}{default}" in heading, name
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'grad_clip'"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(4, 2),
                         grad_clip=1.0)


# --- errors ----------------------------------------------------------------------------------------

def test_unsupported_optimizer_names_the_supported_ones():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match=r"(?s)SparseAdam.*(SGD|Adam).*RMSprop"):
        torchpar.compile(model, torch.optim.SparseAdam(model.parameters()), example_batch=torch.randn(1, 2),
                         loss_fn=lambda out, batch: out.sum())


def test_unsupported_ops_are_all_reported_with_shapes_and_source(monkeypatch):
    from jaxbackend import ops
    from jaxbackend.ops import registry

    ops.get("aten.tanh.default")  # load the registry, then hide two lowerings
    monkeypatch.delitem(registry._REGISTRY, "aten.tanh.default")
    monkeypatch.delitem(registry._REGISTRY, "aten.sigmoid.default")

    class UsesMissingOps(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(5))

        def forward(self, x):
            y = torch.tanh(x)  # the error must point at this line
            y = y * self.scale
            return torch.sigmoid(y).sum()

    model = UsesMissingOps()
    with pytest.raises(NotImplementedError) as info:
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(3, 5))
    message = str(info.value)
    assert "2 op(s)" in message
    assert "aten.tanh.default(float32[3, 5])" in message
    assert "aten.sigmoid.default(float32[3, 5])" in message
    assert "test_engine.py" in message and "torch.tanh(x)" in message


def test_optimizer_param_not_in_model_is_a_clear_error():
    model = torch.nn.Linear(2, 2)
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not a parameter of the model|not in the model"):
        torchpar.compile(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1),
                         example_batch=torch.randn(1, 2), loss_fn=lambda out, batch: out.sum())


def test_batch_structure_and_dtype_mismatch_are_value_errors():
    torch.manual_seed(0)
    model = TinyNet()
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch)
    with pytest.raises(ValueError, match="structure"):
        engine.step((torch.randn(4, 8),))
    with pytest.raises(ValueError, match="float64"):
        engine.step((torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 4)))


def test_loss_must_be_found():
    model = torch.nn.Linear(2, 3)
    with pytest.raises(ValueError, match="loss_fn"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(4, 2))


def test_option_validation():
    with pytest.raises(ValueError):
        torchpar.ShardParallel(mesh_shape=(0, 2))
    with pytest.raises(ValueError):
        torchpar.PipeshardParallel(num_micro_batches=0)
    with pytest.raises(ValueError):
        torchpar.AutoLayerOption(layer_num=0)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="grad_clip_norm"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(4, 2),
                         loss_fn=lambda out, batch: out.sum(), grad_clip_norm=-1.0)


def test_first_day_mistakes_are_named():
    """A method class instead of an instance, a seed that is not an int and a nan learning rate each raise an error
    that says what is wrong and what to write (issue 32)."""
    model = torch.nn.Linear(4, 4)
    batch = torch.randn(2, 4)
    step_fn = lambda m, b: m(b).sum()  # noqa: E731
    with pytest.raises(TypeError, match=r"pass an instance: method=torchpar.DataParallel\(\)"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch, step_fn=step_fn,
                         method=torchpar.DataParallel)
    with pytest.raises(TypeError, match="seed must be an int"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch, step_fn=step_fn,
                         seed=1.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with torchpar.compile(model, optimizer, example_batch=batch, step_fn=step_fn) as engine:
        optimizer.param_groups[0]["lr"] = float("nan")
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] is nan"):
            engine.step(batch)
        engine.sync_to_torch()
    assert torch.equal(model.weight, before)


def test_batch_leaves_are_named_by_their_keys_and_an_empty_batch_is_refused():
    model = torch.nn.Linear(4, 4)
    batch = {"x": torch.randn(2, 4), "labels": torch.randn(2, 4)}
    step_fn = lambda m, b: (m(b["x"]) - b["labels"]).pow(2).mean()  # noqa: E731
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                          step_fn=step_fn) as engine:
        with pytest.raises(ValueError, match=r"batch\['labels'\] is int64\[2, 4\]"):
            engine.step({"x": torch.randn(2, 4), "labels": torch.zeros(2, 4, dtype=torch.int64)})
        with pytest.raises(ValueError, match=r"batch\['x'\] has no rows"):
            engine.step({"x": torch.randn(0, 4), "labels": torch.randn(0, 4)})
