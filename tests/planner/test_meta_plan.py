"""Planning a model built on the meta device (no weights): the same plan as the model with weights, from
``torchpar.plan`` and from ``python -m torchpar plan --meta``; compiling such a model is a clear error."""

from __future__ import annotations

import pytest
import torch
import transformers

import torchpar
from torchpar.__main__ import main
from torchpar.planner.plan import Plan

@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    """The session's local cluster of 8 devices, whatever an earlier module of this worker left."""
    torchpar.init(cluster="local", num_devices=8)


CONFIG = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=64)


def _gpt2(device: str) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
        ids = torch.randint(0, 512, (16, 64))
    return model, {"input_ids": ids, "labels": ids}


def _plan(device: str, method, **options) -> Plan:
    model, batch = _gpt2(device)
    return torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch, method=method,
                         explain=False, **options)


@pytest.mark.parametrize("method", [
    pytest.param(torchpar.ShardParallel(mesh_shape=(2, 4)), id="shard"),
    pytest.param(torchpar.PipeshardParallel(num_micro_batches=4, layer_option=torchpar.AutoLayerOption(layer_num=4)),
                 id="pipeshard"),
])
def test_a_meta_model_plans_as_the_model_with_weights(method):
    meta, real = _plan("meta", method, remat="auto"), _plan("cpu", method, remat="auto")
    assert meta.estimated_step_s == pytest.approx(real.estimated_step_s, rel=1e-9)
    assert meta.remat == real.remat
    for ours, theirs in zip(meta.stages, real.stages, strict=True):
        assert (ours.layers, ours.logical_mesh_shape, ours.params) == (theirs.layers, theirs.logical_mesh_shape,
                                                                      theirs.params)
        # on the meta device a constant attention mask cannot be folded into the kernel's causal flag (its values
        # are unknown): it stays in the graph, a few KiB of activations more
        assert abs(ours.estimated_memory_bytes - theirs.estimated_memory_bytes) <= 64 * 1024



@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_a_meta_model_is_captured_under_the_autocast_policy_of_the_model_with_weights(mixed_precision):
    """Meta tensors have no autocast dispatch: without the fake-CPU capture a meta model's matmuls stayed fp32 and
    its plan priced twice the activation bytes of the model it stands for."""
    from torchpar.capture.export import capture_train_step
    from torchpar.capture.precision import autocast_dtype

    def op_dtypes(device: str) -> list[tuple[str, str]]:
        model, batch = _gpt2(device)
        graph = capture_train_step(model, batch, None, autocast=autocast_dtype(mixed_precision)).graph
        return [(node.target, str(node.out)) for node in graph.nodes]

    def products(ops: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [op for op in ops if op[0] in ("aten.addmm.default", "aten.mm.default", "aten.bmm.default")]

    meta, real = products(op_dtypes("meta")), products(op_dtypes("cpu"))
    low = {"bf16": "bfloat16", "fp16": "float16"}[mixed_precision]
    assert meta == real and sum(out.startswith(low) for _, out in meta) >= 4 * CONFIG["n_layer"]
    meta_plan = _plan("meta", torchpar.ShardParallel(mesh_shape=(2, 4)), mixed_precision=mixed_precision)
    real_plan = _plan("cpu", torchpar.ShardParallel(mesh_shape=(2, 4)), mixed_precision=mixed_precision)
    assert abs(meta_plan.stages[0].estimated_memory_bytes - real_plan.stages[0].estimated_memory_bytes) <= 64 * 1024


def test_compiling_a_meta_model_says_it_has_no_weights():
    model, batch = _gpt2("meta")
    with pytest.raises(ValueError, match=r"transformer\.wte\.weight is on the meta device.*torchpar\.plan"):
        torchpar.compile(model, torch.optim.AdamW(model.parameters()), example_batch=batch)


def test_the_plan_command_builds_the_model_on_the_meta_device(tmp_path, capsys):
    """In this process (JAX already has the session's 8 devices: the CLI's init only declares 2 hosts of 4);
    mixed precision, a 2 GiB budget and the planner choosing remat: every stage fits."""
    config = '{"n_layer": 4, "n_embd": 1024, "n_head": 8, "vocab_size": 2048, "n_positions": 1024}'
    try:
        code = main(["plan", "--meta", "--model", "gpt2", "--config", config, "--batch-size", "64", "--seq-len",
                     "1024", "--devices", "8", "--hosts", "2", "--method", "pipeshard", "--micro-batches", "4",
                     "--layers", "4", "--mixed-precision", "bf16", "--remat", "auto", "--memory-gib", "2",
                     "--out", str(tmp_path / "p.html"), "--json", str(tmp_path / "p.json")])
    finally:
        torchpar.init(cluster="local", num_devices=8)
    out = capsys.readouterr().out
    assert code == 0, out
    plan = Plan.from_json((tmp_path / "p.json").read_text())
    assert plan.solver["remat"]["chosen"] == plan.remat and len(plan.solver["remat"]["candidates"]) == 3
    assert all(stage.estimated_memory_bytes <= 2 * 2**30 for stage in plan.stages)
    assert plan.numerics["mixed_precision"] == "bf16"
    assert "remat: auto → " in out
