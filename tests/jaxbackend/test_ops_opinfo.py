"""Every ATen lowering against PyTorch, on PyTorch's own OpInfo samples.

For each OpInfo in :data:`OPINFOS` and a few of its sample inputs (float32, plus int64 where the op
supports it) the test builds a one-op ``nn.Module``, captures it the way torchpar captures a model
(``capture_forward``: ``torch.export`` + ``run_decompositions`` to core ATen), lowers the graph to
JAX, runs it under ``jax.jit`` and compares each output with eager PyTorch:

- values: fp32 at ``rtol=1e-5, atol=1e-5``; integer and bool results exactly;
- dtypes: the JAX dtype is the one :func:`jaxbackend.dtypes.to_jax` maps torch's result dtype to;
- gradients (differentiable float samples): ``jax.vjp`` of the lowered function against
  ``torch.autograd.grad`` with the same random cotangent, at ``rtol=1e-4, atol=1e-5``.

Random ops (dropout) are checked for shape and for the values they can take, not bit for bit.

Samples that hit a genuine limitation are listed in :data:`SKIPS` (whole OpInfos) and
:func:`sample_skip_reason` (single samples), each with its reason; nothing is skipped silently.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from torch.testing._internal.common_methods_invocations import op_db

from jaxbackend import dtypes
from jaxbackend.lower import lower, to_numpy_input
from torchpar.capture.export import capture_forward, dtype_name

RTOL, ATOL = 1e-5, 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
FLOAT_SAMPLES, INT_SAMPLES = 3, 2

# The OpInfos under test: what HF text and vision models (and their losses) emit, grouped by family.
OPINFOS: tuple[str, ...] = (
    # unary math
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cos", "cosh", "deg2rad", "digamma",
    "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac", "isfinite", "isinf", "isnan",
    "lgamma", "log", "log10", "log1p", "log2", "logit", "nan_to_num", "neg", "positive", "rad2deg",
    "reciprocal", "round", "round.decimals_3", "rsqrt", "sgn", "sigmoid", "sign", "signbit", "sin",
    "sinh", "sqrt", "square", "tan", "tanh", "trunc", "bitwise_not", "logical_not",
    # binary / ternary math
    "add", "sub", "rsub", "mul", "div.no_rounding_mode", "div.floor_rounding", "div.trunc_rounding",
    "true_divide", "floor_divide", "remainder", "fmod", "pow", "atan2", "hypot", "maximum", "minimum",
    "fmax", "fmin", "copysign", "xlogy", "lerp", "addcmul", "addcdiv", "clamp", "clamp_min", "clamp_max",
    "where", "logaddexp", "heaviside",
    # comparisons and logic
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "bitwise_and",
    "bitwise_or", "bitwise_xor", "isclose",
    # activations
    "nn.functional.gelu", "nn.functional.silu", "nn.functional.mish", "nn.functional.relu",
    "nn.functional.relu6", "nn.functional.elu", "nn.functional.celu", "nn.functional.selu",
    "nn.functional.leaky_relu", "nn.functional.hardtanh", "nn.functional.hardsigmoid",
    "nn.functional.hardswish", "nn.functional.softplus", "nn.functional.logsigmoid",
    "nn.functional.softsign", "nn.functional.tanhshrink", "nn.functional.hardshrink",
    "nn.functional.softshrink", "nn.functional.threshold", "nn.functional.glu", "nn.functional.prelu",
    # reductions
    "sum", "mean", "prod", "amax", "amin", "max.reduction_no_dim", "max.reduction_with_dim",
    "min.reduction_no_dim", "min.reduction_with_dim", "argmax", "argmin", "var", "var.unbiased",
    "var_mean", "std", "std_mean", "all", "any", "logsumexp", "cumsum", "cumprod", "linalg.vector_norm",
    "norm", "count_nonzero", "nansum", "aminmax",
    # softmax family
    "softmax", "softmax.with_dtype", "log_softmax", "log_softmax.with_dtype", "nn.functional.softmin",
    "torch.ops.aten._safe_softmax.default",
    # normalization
    "nn.functional.layer_norm", "nn.functional.group_norm", "nn.functional.batch_norm",
    "nn.functional.rms_norm", "nn.functional.instance_norm", "nn.functional.normalize",
    "native_layer_norm", "native_batch_norm",
    # products and convolutions
    "nn.functional.linear", "matmul", "mm", "bmm", "addmm", "addmm.decomposed", "baddbmm", "addbmm",
    "addmv", "mv", "dot", "outer", "einsum", "tensordot", "inner", "nn.functional.bilinear",
    "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv_transpose1d",
    "nn.functional.conv_transpose2d",
    # embedding, pooling, upsampling
    "nn.functional.embedding", "nn.functional.one_hot", "nn.functional.max_pool1d",
    "nn.functional.max_pool2d", "nn.functional.avg_pool1d", "nn.functional.avg_pool2d",
    "nn.functional.adaptive_avg_pool1d", "nn.functional.adaptive_avg_pool2d",
    "nn.functional.interpolate.nearest", "nn.functional.interpolate.bilinear",
    "nn.functional.interpolate.linear", "nn.functional.upsample_nearest",
    "nn.functional.pixel_shuffle", "nn.functional.pixel_unshuffle",
    # losses
    "nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.mse_loss",
    "nn.functional.l1_loss", "nn.functional.smooth_l1_loss", "nn.functional.huber_loss",
    "nn.functional.binary_cross_entropy", "nn.functional.binary_cross_entropy_with_logits",
    "nn.functional.kl_div", "nn.functional.cosine_similarity",
    # attention and dropout
    "nn.functional.scaled_dot_product_attention", "nn.functional.dropout",
    # indexing
    "gather", "scatter", "scatter_add", "scatter_reduce.sum", "scatter_reduce.amax",
    "scatter_reduce.amin", "scatter_reduce.mean", "scatter_reduce.prod", "index_select", "index_put",
    "index_add", "index_copy", "index_fill", "masked_fill", "take_along_dim", "__getitem__", "select",
    "narrow", "slice", "select_scatter", "slice_scatter", "diagonal", "diag_embed",
    # shape
    "cat", "stack", "hstack", "vstack", "split", "split.list_args", "split_with_sizes", "chunk",
    "tensor_split", "unbind", "flip", "fliplr", "flipud", "roll", "rot90", "tril", "triu", "t",
    "transpose", "permute", "reshape", "view", "view_as", "flatten", "unflatten", "squeeze",
    "squeeze.multiple", "unsqueeze", "expand", "expand_as", "broadcast_to", "repeat", "tile",
    "repeat_interleave", "movedim", "constant_pad_nd", "nn.functional.pad.constant",
    "nn.functional.pad.reflect", "nn.functional.pad.replicate", "nn.functional.pad.circular",
    "contiguous", "clone", "unfold",
    # sorting
    "sort", "argsort", "topk", "msort", "bucketize", "searchsorted",
    # creation and conversion
    "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "zeros", "ones",
    "full", "arange", "linspace", "eye", "tril_indices", "triu_indices", "scalar_tensor", "float",
    "long", "int", "bool", "to",
)

# Whole OpInfos (or one dtype of one, as "name@int64") that cannot pass, with the reason.
SKIPS: dict[str, str] = {}

# Per-sample limitations: (OpInfo name, predicate on the sample, reason). Checked in order.
SAMPLE_SKIPS: list[tuple[str, Any, str]] = []

# Random ops: compared by shape and by the values they can take, not bit for bit.
RANDOM = {"nn.functional.dropout"}


def sample_skip_reason(name: str, sample: Any) -> str | None:
    for op_name, predicate, reason in SAMPLE_SKIPS:
        if op_name == name and predicate(sample):
            return reason
    return None


# --- sample selection ------------------------------------------------------------------------------

_BY_NAME = {op.name + (f".{op.variant_test_name}" if op.variant_test_name else ""): op for op in op_db}


def _samples(op, dtype: torch.dtype) -> list[Any]:
    """A few samples spread over the OpInfo's list (first, last and between), with a fixed seed."""
    torch.manual_seed(0)
    every = list(op.sample_inputs("cpu", dtype, requires_grad=dtype.is_floating_point and op.supports_autograd))
    count = FLOAT_SAMPLES if dtype.is_floating_point else INT_SAMPLES
    picks = sorted(set(np.linspace(0, len(every) - 1, min(count, len(every))).round().astype(int).tolist()))
    return [every[i] for i in picks]


def _params():
    for name in OPINFOS:
        marks = [pytest.mark.skip(reason=SKIPS[name])] if name in SKIPS else []
        yield pytest.param(name, marks=marks, id=name)


class _Case:
    """One sample: its label, the OpInfo call with its tensors as inputs, and eager torch's results."""

    def __init__(self, name: str, op, dtype: torch.dtype, index: int, sample: Any):
        self.name, self.op, self.sample = name, op, sample
        self.label = f"{dtype_name(dtype)}[{index}]"
        self.leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        # One graph input per distinct tensor, so a tensor used twice gets one (summed) gradient.
        self.tensors: list[torch.Tensor] = []
        self.slots: dict[int, int] = {}
        for i, leaf in enumerate(self.leaves):
            if isinstance(leaf, torch.Tensor):
                ids = [id(t) for t in self.tensors]
                if id(leaf) not in ids:
                    self.tensors.append(leaf)
                self.slots[i] = [id(t) for t in self.tensors].index(id(leaf))

    def call(self, tensors) -> Any:
        leaves = list(self.leaves)
        for leaf_index, tensor_index in self.slots.items():
            leaves[leaf_index] = tensors[tensor_index]
        first, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.op(first, *args, **kwargs)

    def expected(self) -> list[torch.Tensor]:
        out, _ = pytree.tree_flatten(self.call(self.tensors))
        assert all(isinstance(o, torch.Tensor) for o in out), f"non-tensor output {out}"
        return out


class _Batch(torch.nn.Module):
    """Calls every case on its own slice of the inputs; returns their outputs, flattened."""

    def __init__(self, cases: list[_Case]):
        super().__init__()
        self.cases = cases
        self.starts = np.cumsum([0] + [len(c.tensors) for c in cases]).tolist()

    def forward(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        outputs = []
        for case, start, end in zip(self.cases, self.starts[:-1], self.starts[1:]):
            outputs.extend(pytree.tree_flatten(case.call(tensors[start:end]))[0])
        return outputs


# --- running and comparing -------------------------------------------------------------------------

def _run_lowered(cases: list[_Case], wants: list[list[torch.Tensor]], grad_cases: list[bool]):
    """Capture, lower and jit the cases together; returns per case ``(outputs, input_grads)``.

    Gradients are ``jax.vjp`` of the lowered function with a cotangent drawn from a fixed seed (the same
    one :func:`_torch_grads` uses), for the float inputs that require grad.
    """
    module = _Batch(cases)
    inputs = [t.detach() for c in cases for t in c.tensors]
    fn = lower(capture_forward(module, tuple(inputs)).graph)
    jax_inputs = [to_numpy_input(t.numpy()) for t in inputs]
    diff_slots = [module.starts[k] + i for k, c in enumerate(cases) if grad_cases[k]
                  for i, t in enumerate(c.tensors) if t.requires_grad]
    out_starts = np.cumsum([0] + [len(w) for w in wants]).tolist()
    cot_slots = [out_starts[k] + i for k, w in enumerate(wants) if grad_cases[k]
                 for i, o in enumerate(w) if o.dtype.is_floating_point and o.requires_grad]
    cotangents = [_cotangent(w) for k, ws in enumerate(wants) if grad_cases[k]
                  for w in ws if w.dtype.is_floating_point and w.requires_grad]

    def forward(diff_inputs):
        full = list(jax_inputs)
        for slot, value in zip(diff_slots, diff_inputs):
            full[slot] = value
        return fn({}, {}, full, jax.random.key(0))[0]

    @jax.jit
    def run(diff_inputs, cots):
        outputs = forward(diff_inputs)
        if not cot_slots:
            return outputs, []
        _, vjp = jax.vjp(lambda d: [forward(d)[i] for i in cot_slots], diff_inputs)
        return outputs, vjp([c.astype(outputs[i].dtype) for c, i in zip(cots, cot_slots)])[0]

    outputs, grads = run([jax_inputs[i] for i in diff_slots], [c.numpy() for c in cotangents])
    assert len(outputs) == out_starts[-1], f"{len(outputs)} outputs, torch has {out_starts[-1]}"
    grad_of = dict(zip(diff_slots, grads))
    results = []
    for k, case in enumerate(cases):
        case_grads = [grad_of.get(module.starts[k] + i) for i in range(len(case.tensors))]
        results.append((outputs[out_starts[k]:out_starts[k + 1]], case_grads))
    return results


def _cotangent(out: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(out.numel())
    return torch.randn(out.shape, generator=gen, dtype=torch.float32)


def _torch_grads(case: _Case, want: list[torch.Tensor]) -> list[torch.Tensor | None]:
    outs = [w for w in want if w.dtype.is_floating_point and w.requires_grad]
    needs = [t for t in case.tensors if t.requires_grad]
    grads = iter(torch.autograd.grad(outs, needs, [_cotangent(o).to(o.dtype) for o in outs], allow_unused=True))
    return [(next(grads) if t.requires_grad else None) for t in case.tensors]


def _check_case(case: _Case, want: list[torch.Tensor], got: list[Any], grads: list[Any], check_grads: bool):
    for i, (g, w) in enumerate(zip(got, want)):
        expected_dtype = dtypes.to_jax(dtype_name(w.dtype))
        assert g.dtype == expected_dtype, f"output {i}: JAX dtype {g.dtype}, torch {w.dtype} → {expected_dtype}"
        if case.name in RANDOM:
            _check_random(case, _to_torch(g))
        else:
            _assert_close(g, w.detach(), RTOL, ATOL, f"output {i}")
    if check_grads:
        for i, (g, w) in enumerate(zip(grads, _torch_grads(case, want))):
            if g is not None:
                w = torch.zeros_like(case.tensors[i]) if w is None else w
                _assert_close(g, w.detach(), GRAD_RTOL, GRAD_ATOL, f"grad of input {i}")


def _to_torch(array) -> torch.Tensor:
    return torch.from_numpy(np.array(array))


def _assert_close(got, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    got = _to_torch(got)
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, torch {tuple(want.shape)}"
    if want.dtype.is_floating_point:
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got.to(want.dtype), want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _check_random(case: _Case, got: torch.Tensor) -> None:
    """Dropout: each element is 0 or ``x / (1 - p)``; exactly ``x`` for ``p = 0`` or not training."""
    x = case.sample.input.detach()
    p = case.sample.kwargs.get("p", 0.5)
    if p == 0 or not case.sample.kwargs.get("training", True):
        torch.testing.assert_close(got, x, rtol=0, atol=0)
    elif p == 1:
        torch.testing.assert_close(got, torch.zeros_like(x), rtol=0, atol=0)
    else:
        kept = got != 0
        torch.testing.assert_close(got[kept], x[kept] / (1 - p), rtol=RTOL, atol=ATOL)


# --- the test --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", _params())
def test_opinfo(name: str, subtests) -> None:
    """All selected samples of one OpInfo in one captured graph; one subtest per sample.

    If the joint capture or run fails, each sample is captured and run alone, so the report names the
    samples at fault.
    """
    op = _BY_NAME[name]
    cases = []
    for dtype in (torch.float32, torch.int64):
        if dtype not in op.supported_dtypes("cpu"):
            continue
        key = f"{name}@{dtype_name(dtype)}"
        for index, sample in enumerate(_samples(op, dtype)):
            case = _Case(name, op, dtype, index, sample)
            reason = SKIPS.get(key) or sample_skip_reason(name, sample)
            if reason:
                with subtests.test(msg=case.label):
                    pytest.skip(reason)
            else:
                cases.append(case)
    if not cases:
        return
    wants = [c.expected() for c in cases]
    grad_cases = [name not in RANDOM and any(t.requires_grad for t in c.tensors)
                  and any(w.dtype.is_floating_point and w.requires_grad for w in ws) for c, ws in zip(cases, wants)]
    try:
        results = _run_lowered(cases, wants, grad_cases)
    except Exception:
        results = None
    for k, case in enumerate(cases):
        with subtests.test(msg=case.label):
            got, grads = results[k] if results is not None else _run_lowered([case], [wants[k]], [grad_cases[k]])[0]
            _check_case(case, wants[k], got, grads, grad_cases[k])
