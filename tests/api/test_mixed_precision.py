"""Low-precision parameters and mixed precision, against PyTorch itself.

Tolerances (relative, per-step loss, 6 AdamW steps), measured on this machine and stated as bf16/fp16 ulps
(bf16: 2⁻⁸ ≈ 3.9e-3; fp16: 2⁻¹¹ ≈ 4.9e-4):

- **bf16 / fp16 parameters** (``model.to(dtype)``) vs PyTorch with ``AdamW(fused=True)``: the fused kernel
  computes the update in float32 and rounds it once, as torchpar does (torch's default for-loop AdamW rounds
  after every op of the update). Measured: bf16 GPT-2 1.2e-4, Llama 8e-5, ViT 1.3e-2 (PyTorch's own 1-vs-4-thread
  spread on that ViT is 6.5e-3); fp16 GPT-2 9e-5 (PyTorch's own 1-vs-2-thread spread 2e-5), Llama 6e-5, ViT 8e-4.
  Bars: bf16 2e-2 (~5 ulps), fp16 2e-3 (~4 ulps). The difference is rounding inside the low-precision forward and
  backward: XLA keeps fused elementwise chains in float32 between roundings, PyTorch rounds after each op.
- **fp16 GPT-2** is the regression case for normalization in half precision: its initial residual stream has std
  ~0.02, so ``var + eps < 6.1e-4`` and the ``rstd³`` in the derivative of ``rsqrt(var + eps)`` overflows fp16. PyTorch
  computes layer/group/batch norm (and their backward) in float32 and rounds the results; before the lowering did
  the same, the first step's gradients were NaN. ``test_fp16_normalization_of_small_activations`` checks the three
  norms alone: measured 2.8e-4 per-step loss (SGD, 4 steps), under the fp16 bar.
- **Mixed precision** vs PyTorch under ``torch.autocast("cpu", dtype)`` (+ ``GradScaler`` for fp16) with float32
  weights: measured bf16 GPT-2 1.4e-4, Llama 3.7e-5, ViT 1.6e-3; fp16 ≤ 1.4e-4. Bars: bf16 5e-3 (~1 ulp of the
  bf16 matmul outputs), fp16 1e-3 (~2 ulps).
"""

from __future__ import annotations

import copy

import pytest
import torch

import torchpar
from tests.models import hf_configs

STEPS = 6
LOW_PRECISION_RTOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
MIXED_RTOL = {"bf16": 5e-3, "fp16": 1e-3}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cast_batch(batch: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def torch_losses(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer,
                 mixed: str | None = None, scaler: torch.amp.GradScaler | None = None) -> list[float]:
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        with torch.autocast("cpu", AUTOCAST[mixed]) if mixed else torch.autocast("cpu", enabled=False):
            loss = model(**batch).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        losses.append(float(loss))
    return losses


def assert_close_per_step(ours: list[float], ref: list[float], rtol: float, what: str) -> None:
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, ref))
    assert worst <= rtol, f"{what}: worst per-step relative loss difference {worst:.2e} > {rtol:.0e}\n" \
                          f"torchpar {ours}\npytorch  {ref}"


@pytest.fixture(scope="module", autouse=True)
def one_device():
    torchpar.init(cluster="local", num_devices=1)
    yield
    torchpar.init(cluster="local", num_devices=8)  # the session's cluster, for the next module in this worker


@pytest.mark.parametrize("family, dtype", [("gpt2", torch.bfloat16), ("llama", torch.bfloat16),
                                           ("vit", torch.bfloat16), ("gpt2", torch.float16),
                                           ("llama", torch.float16), ("vit", torch.float16)])
def test_low_precision_parameters_train_like_pytorch(family, dtype):
    torch.manual_seed(0)
    base, batch = getattr(hf_configs, family)()
    base, batch = base.to(dtype), cast_batch(batch, dtype)
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
    ref = torch_losses(ref_model, batch, torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=1e-4, fused=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    with torchpar.compile(model, optimizer, example_batch=batch) as engine:
        ours = [engine.step(batch).item() for _ in range(STEPS)]
        assert_close_per_step(ours, ref, LOW_PRECISION_RTOL[dtype], f"{family} in {dtype}")
        state = engine.state_dict()
        engine.sync_to_torch()
        for name, param in model.named_parameters():  # the engine's values, exactly, in the model's dtype
            assert param.dtype == dtype
            assert torch.equal(param.detach(), state["params"][name]), name
        after = engine.step(batch)
        engine.load_state_dict(state)  # a bf16/fp16 checkpoint restores exactly: the same step again
        assert engine.step(batch) == after


class SmallVarianceNorms(torch.nn.Module):
    """Layer, group and batch norm of a trainable input with std 0.02 (GPT-2's initial activations): in fp16 the
    derivative of ``rsqrt(var + eps)`` is ``-rstd³/2 ≈ -6e4``, past fp16's range unless computed in float32."""

    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.randn(8, 4, 6, 6) * 0.02)
        self.ln, self.gn, self.bn = torch.nn.LayerNorm(36), torch.nn.GroupNorm(2, 4), torch.nn.BatchNorm2d(4)

    def forward(self, y):
        h = self.ln(self.x.flatten(2)).view_as(self.x) + self.gn(self.x) + self.bn(self.x)
        return torch.nn.functional.mse_loss(h.float(), y)


def test_fp16_normalization_of_small_activations():
    """The gradient through each norm reaches ``x`` finite and as PyTorch's (its kernels compute in float32): the
    per-step losses of 4 SGD steps agree within the fp16 bar (measured 2.8e-4), and so do the parameters
    (measured ≤ 1.6e-3 of each one's largest magnitude: ~3 fp16 ulps after 4 roundings of the update)."""
    torch.manual_seed(0)
    base, y = SmallVarianceNorms().half(), torch.randn(8, 4, 6, 6)
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref = []
    for _ in range(4):
        ref_opt.zero_grad()
        loss = ref_model(y)
        loss.backward()
        assert torch.isfinite(ref_model.x.grad).all()
        ref_opt.step()
        ref.append(float(loss))
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=(y,)) as engine:
        ours = [engine.step((y,)).item() for _ in range(4)]  # on_nonfinite="raise": a NaN gradient raises here
        assert_close_per_step(ours, ref, LOW_PRECISION_RTOL[torch.float16], "fp16 norms of small activations")
        engine.sync_to_torch()
    for (name, param), expected in zip(model.named_parameters(), ref_model.parameters()):
        assert param.dtype == torch.float16
        torch.testing.assert_close(param.float(), expected.float(), rtol=0,
                                   atol=4e-3 * float(expected.abs().max()), msg=name)


@pytest.mark.parametrize("family, mixed", [("gpt2", "bf16"), ("llama", "bf16"), ("vit", "bf16"),
                                           ("gpt2", "fp16"), ("vit", "fp16")])
def test_mixed_precision_matches_torch_autocast(family, mixed):
    torch.manual_seed(0)
    base, batch = getattr(hf_configs, family)()
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
    scaler = torch.amp.GradScaler("cpu") if mixed == "fp16" else None
    ref = torch_losses(ref_model, batch, torch.optim.AdamW(ref_model.parameters(), lr=1e-3), mixed, scaler)
    with torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch,
                          mixed_precision=mixed) as engine:
        ours = [engine.step(batch).item() for _ in range(STEPS)]
        assert_close_per_step(ours, ref, MIXED_RTOL[mixed], f"{family} under {mixed} autocast")
        assert engine.numerics["mixed_precision"] == mixed
        assert all(p.dtype == torch.float32 for p in engine.state_dict()["params"].values())  # fp32 master weights
        assert engine.loss_scale == (scaler.get_scale() if scaler is not None else None)
        low = {"bf16": "bfloat16", "fp16": "float16"}[mixed]
        products = [n for n in engine.graph.nodes if n.target in ("aten.addmm.default", "aten.mm.default",
                                                                   "aten.bmm.default", "aten.convolution.default")]
        assert products and all(n.out.dtype == low for n in products)  # autocast's policy is in the graph


class Overflowing(torch.nn.Module):
    """A regression whose scaled fp16 gradients overflow until the loss scale has backed off a few times."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x).float(), y)


def gradscaler_reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float,
                         steps: int = 8) -> tuple[list[float], list[float], int]:
    """PyTorch's fp16 autocast + GradScaler run of ``model(x, y)`` with SGD (momentum 0.9), in place: per-step
    losses, the scale after each step and how many steps it skipped (checked to be some, not all)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    losses, scales = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(float(loss))
    skipped = sum(a > b for a, b in zip([65536.0] + scales, scales))
    assert 0 < skipped < steps, f"the case must overflow at first and then train: scales {scales}"
    return losses, scales, skipped


def test_fp16_loss_scaling_skips_the_steps_gradscaler_skips():
    torch.manual_seed(0)
    base = Overflowing()
    x, y = torch.randn(32, 64) * 30, torch.randn(32, 64) * 30
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_losses, ref_scales, skipped = gradscaler_reference(ref_model, x, y, lr=1e-5)

    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=1e-5, momentum=0.9), example_batch=(x, y),
                          mixed_precision="fp16") as engine:
        scales, losses = [], []
        for _ in range(8):
            losses.append(engine.step((x, y)).item())
            scales.append(engine.loss_scale)
        assert scales == ref_scales
        assert engine.skipped_steps == skipped
        assert_close_per_step(losses, ref_losses, MIXED_RTOL["fp16"], "the overflowing regression")
        assert engine.state_dict()["loss_scaler"]["scale"] == ref_scales[-1]
        engine.sync_to_torch()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, dict(ref_model.named_parameters())[name], rtol=1e-3, atol=1e-5)


class OverflowingPipeline(torch.nn.Module):
    """:class:`Overflowing` in two pipeline stages (``mark_pipeline_boundary`` between its two layers)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x, y):
        hidden = torchpar.mark_pipeline_boundary(self.fc1(x))
        return torch.nn.functional.mse_loss(self.fc2(hidden).float(), y)


def test_fp16_loss_scaling_in_a_pipeline_skips_the_steps_gradscaler_skips():
    """Two stages × two micro-batches: the last stage seeds its loss with S/M, the update unscales by 1/S, a
    step with an overflow anywhere is skipped on every stage, and the scale follows GradScaler's on the whole
    batch (the micro-batches' mean loss and summed gradients are the full batch's)."""
    torch.manual_seed(0)
    base = OverflowingPipeline()
    x, y = torch.randn(32, 64) * 30, torch.randn(32, 64) * 30
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_losses, ref_scales, skipped = gradscaler_reference(ref_model, x, y, lr=1e-6)

    torchpar.init(cluster="local", num_devices=2)
    try:
        method = torchpar.PipeshardParallel(num_micro_batches=2, layer_option="manual")
        with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9),
                              example_batch=(x, y), method=method, mixed_precision="fp16") as engine:
            assert len(engine.plan.stages) == 2
            scales, losses = [], []
            for _ in range(8):
                losses.append(engine.step((x, y)).item())
                scales.append(engine.loss_scale)
            assert scales == ref_scales
            assert engine.skipped_steps == skipped
            assert_close_per_step(losses, ref_losses, MIXED_RTOL["fp16"], "the overflowing pipeline")
            engine.sync_to_torch()
    finally:
        torchpar.init(cluster="local", num_devices=1)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, dict(ref_model.named_parameters())[name], rtol=1e-3, atol=1e-5)
