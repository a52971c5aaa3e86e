"""Matmul precision follows PyTorch's settings, asserted on the lowered programs (never on timings).

The GPU mapping is checked by lowering the training step for the ``cuda`` platform on this CPU machine
(``lowering_platforms``): StableHLO shows each ``dot_general``'s precision or algorithm.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchpar
from jaxbackend.lower import lower
from jaxbackend.precision import Numerics
from torchpar.capture.export import capture_train_step
from torchpar.capture.precision import resolve_precisions

DOT = re.compile(r"stablehlo\.(dot_general|convolution)[^\n]*")


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc(self.conv(x).flatten(1)), y)


def lowered_step(numerics: Numerics, dtype: torch.dtype = torch.float32) -> str:
    """StableHLO of forward + backward of :class:`ConvNet`, lowered for ``numerics.platform``."""
    torch.manual_seed(0)
    model = ConvNet().to(dtype)
    batch = (torch.randn(2, 3, 8, 8, dtype=dtype), torch.tensor([1, 3]))
    graph = capture_train_step(model, batch).graph
    run = lower(graph, numerics=numerics)
    jdtype = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    params = {n: jax.ShapeDtypeStruct(tuple(p.shape), jdtype) for n, p in model.named_parameters()}
    inputs = [jax.ShapeDtypeStruct((2, 3, 8, 8), jdtype), jax.ShapeDtypeStruct((2,), jnp.int32)]

    def loss_and_grads(params, inputs):
        return jax.value_and_grad(lambda p: run(p, {}, inputs, jax.random.key(0))[0][0])(params)

    traced = jax.jit(loss_and_grads).trace(params, inputs)
    return traced.lower(lowering_platforms=(numerics.platform,)).as_text()


def products(text: str) -> list[str]:
    return [m.group(0) for m in DOT.finditer(text)]


def full_fp32(op: str) -> bool:
    """A product at ``Precision.HIGHEST`` (dot_general and convolution print it differently)."""
    highest = "precision = [HIGHEST, HIGHEST]" in op or "precision HIGHEST>, #stablehlo<precision HIGHEST>" in op
    return highest and "algorithm" not in op


@pytest.mark.parametrize("matmul, algorithm", [("high", "tf32"), ("medium", "bf16")])
def test_gpu_float32_products_use_the_asked_algorithm_forward_and_backward(matmul, algorithm):
    ops = products(lowered_step(Numerics(matmul=matmul, conv="high", platform="cuda")))
    dots = [op for op in ops if "dot_general" in op]
    assert len(dots) >= 3  # the forward product and both gradients of the Linear layer
    for op in dots:
        assert f"lhs_precision_type = {algorithm}" in op and "accumulation_type = f32" in op, op
    convs = [op for op in ops if "convolution" in op]
    assert convs and all("HIGHEST" not in op for op in convs)  # TF32 convolutions: XLA's default precision


def test_gpu_highest_keeps_full_fp32_everywhere():
    ops = products(lowered_step(Numerics(matmul="highest", conv="highest", platform="cuda")))
    assert ops and all(full_fp32(op) for op in ops)


def test_cpu_computes_fp32_products_whatever_is_asked():
    ops = products(lowered_step(Numerics(matmul="medium", conv="high", platform="cpu")))
    assert ops and all(full_fp32(op) for op in ops)


def test_bf16_operands_use_native_products_on_gpu():
    ops = products(lowered_step(Numerics(matmul="highest", platform="cuda"), dtype=torch.bfloat16))
    dots = [op for op in ops if "dot_general" in op]
    assert dots and all("bf16" in op and "HIGHEST" not in op and "algorithm" not in op for op in dots)


@pytest.fixture
def torch_precision():
    """Restores PyTorch's float32 matmul precision (and its TF32 switch) after the test."""
    matmul = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(matmul)


def cudnn_tf32(allowed: bool):
    """``torch.backends.cudnn.allow_tf32 = allowed`` inside the block. Through ``cudnn.flags``: PyTorch's own test
    utilities (imported by the op tests) freeze the global cuDNN flags, and assigning them then raises."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                       allow_tf32=allowed)


def test_precision_follows_torch_unless_named(torch_precision):
    torch.set_float32_matmul_precision("highest")
    with cudnn_tf32(False):
        assert resolve_precisions(None) == ("highest", "highest")
    torch.backends.cuda.matmul.allow_tf32 = True  # PyTorch's TF32 switch makes its precision "high"
    assert resolve_precisions(None)[0] == "high"
    torch.set_float32_matmul_precision("medium")
    with cudnn_tf32(True):
        assert resolve_precisions(None) == ("medium", "high")
    assert resolve_precisions("highest") == ("highest", "highest")  # an explicit choice wins
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        resolve_precisions("tf32")


@pytest.fixture
def one_device():
    torchpar.init(cluster="local", num_devices=1)
    yield
    torchpar.init(cluster="local", num_devices=8)  # the session's cluster, for the next test in this worker


def test_engine_and_plan_say_what_they_compiled_with(torch_precision, monkeypatch, capfd, one_device):
    monkeypatch.setenv("TORCHPAR_PROGRESS", "1")  # the compile phases' progress bar, forced on without a TTY
    torch.set_float32_matmul_precision("high")
    model = ConvNet()
    batch = (torch.randn(2, 3, 8, 8), torch.tensor([1, 3]))
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch) as engine:
        assert engine.numerics["matmul_precision"] == "high"
        assert engine.numerics["effective"].endswith("on cpu") and "fp32 products: fp32" in engine.numerics["effective"]
        assert engine.plan.numerics == engine.numerics
        assert "numerics: fp32 products" in engine.plan.summary()
        assert torchpar.Plan.from_dict(engine.plan.to_dict()).numerics == engine.numerics
        assert np.isfinite(engine.step(batch))
    progress = capfd.readouterr().err
    assert "torchpar: compiling the training step" in progress and "XLA compile" in progress
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                         mixed_precision="float16")


def test_the_autocast_policy_is_the_model_devices():
    """``torch.autocast`` only casts ops on its own device type, so the capture takes the model's (a CUDA model
    gets CUDA's policy); meta tensors have no autocast and take the CPU's."""
    from torchpar.capture.precision import autocast_device

    assert autocast_device(torch.nn.Linear(2, 2), []) == "cpu"
    assert autocast_device(torch.nn.Linear(2, 2, device="meta"), []) == "cpu"
    assert autocast_device(torch.nn.ReLU(), [torch.zeros(1)]) == "cpu"  # no parameters: the batch's device
