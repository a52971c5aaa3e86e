"""The fault table of a training step: malformed batches, out-of-range indices, inf/nan, divergence, bad options
and resources. Each case names the error class and the words a user needs; none of them may pass silently.

Engines are shared per module (one tiny GPT-2 on one device, one under DataParallel over 2 devices), so the
table costs a few compilations, not one per case.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import torchpar
from jaxbackend.lower import LoweringError
from torchpar.ir.index_inputs import InputRangeError
from torchpar.runtime.nonfinite import NonFiniteError
from torchpar.runtime.resources import DeviceMemoryError

VOCAB, SEQ, BATCH = 512, 16, 4


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _batch(**changes: Any) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    batch = {"input_ids": ids, "labels": ids.clone()}
    for key, (index, value) in changes.items():
        batch[key] = batch[key].clone()
        batch[key][index] = value
    return batch


@pytest.fixture(scope="module", params=["one_device", "data_parallel"])
def gpt2_engine(request):
    model = _gpt2()
    method = torchpar.DataParallel(mesh_shape=(1, 2)) if request.param == "data_parallel" else None
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_batch(),
                          method=method) as engine:
        yield engine


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    batch: Callable[[], Any]
    error: type[BaseException]
    words: tuple[str, ...]


INDEX_CASES = [
    Case("token_id_past_vocab", lambda: _batch(input_ids=((1, 3), 9999)), InputRangeError,
         ("batch['input_ids'] holds 9999 at index [1, 3]", "0 … 511", "transformer.wte.weight", "modeling_gpt2.py",
          "check_inputs=False")),
    Case("negative_token_id", lambda: _batch(input_ids=((0, 0), -1)), InputRangeError,
         ("batch['input_ids'] holds -1", "0 … 511")),
    Case("label_past_vocab", lambda: _batch(labels=((2, 5), 700)), InputRangeError,
         ("batch['labels'] holds 700", "-100 (ignore_index)", "cross-entropy")),
    Case("negative_label_not_ignore_index", lambda: _batch(labels=((0, 1), -5)), InputRangeError,
         ("batch['labels'] holds -5",)),
    Case("missing_labels_key", lambda: {"input_ids": _batch()["input_ids"]}, ValueError, ("labels",)),
    Case("extra_key", lambda: {**_batch(), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)},
         ValueError, ("attention_mask",)),
    Case("float_token_ids", lambda: {"input_ids": torch.zeros(BATCH, SEQ), "labels": _batch()["labels"]},
         ValueError, ("float32", "int64", "dtype")),
    Case("token_ids_of_wrong_rank", lambda: {"input_ids": torch.zeros(BATCH * SEQ, dtype=torch.long),
                                             "labels": _batch()["labels"]}, ValueError, ("rank",)),
    Case("non_tensor_leaf", lambda: {"input_ids": [[1, 2]], "labels": _batch()["labels"]}, TypeError,
         ("torch.Tensor", "batch['input_ids'][0][0] is a int")),
]


@pytest.mark.parametrize("case", INDEX_CASES, ids=[c.id for c in INDEX_CASES])
def test_bad_batches_raise_with_what_to_fix(gpt2_engine, case):
    before = gpt2_engine.step(_batch())
    with pytest.raises(case.error) as info:
        gpt2_engine.step(case.batch())
    for words in case.words:
        assert words in str(info.value), f"{words!r} not in:\n{info.value}"
    assert "TreeSpec" not in str(info.value)
    assert np.isfinite(before)


def test_ignore_index_labels_and_the_off_switch_pass(gpt2_engine):
    assert np.isfinite(gpt2_engine.step(_batch(labels=((0, slice(0, 4)), -100))))
    assert isinstance(gpt2_engine.forward({"input_ids": _batch()["input_ids"], "labels": _batch()["labels"]}),
                      transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
    with pytest.raises(InputRangeError, match="holds 4096"):
        gpt2_engine.forward(_batch(input_ids=((0, 0), 4096)))


def test_a_batch_that_counts_no_token_says_so():
    """Every label -100: PyTorch's token-mean cross-entropy is 0 / 0 = nan; the error names the division and why."""
    model = _gpt2()
    batch = _batch(labels=((slice(None), slice(None)), -100))
    assert torch.isnan(model(**batch).loss)  # PyTorch's own answer
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_batch()) as engine:
        with pytest.raises(NonFiniteError, match=r"(?s)aten\.div\.Tensor.*0 / 0.*counts no token.*ignore_index, "
                                                 r"-100.*PyTorch's loss is nan.*on_nonfinite='skip'"):
            engine.step(batch)


class _Counts(torch.nn.Module):
    """Reads an int64 leaf as numbers (not as indices): the index-range check does not see it."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, counts, target):
        return ((counts.float() * 1e-9 * self.scale - target) ** 2).mean()


def test_an_int64_leaf_beyond_int32_is_refused_not_wrapped():
    """JAX runs int64 as int32 (x64 off): 2**33 + 7 would silently become 7; the step refuses it naming the leaf."""
    model = _Counts()
    example = (torch.arange(4, dtype=torch.int64), torch.zeros(4))
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=example) as engine:
        assert np.isfinite(engine.step(example))
        with pytest.raises(ValueError, match=r"(?s)batch leaf .*int64.*\[0, 8589934599\], outside int32's range.*"
                                             r"x64 off.*wrap"):
            engine.step((torch.tensor([0, 1, 2, 2**33 + 7]), torch.zeros(4)))


class _Hashed(torch.nn.Module):
    """The hashing trick with a multiplier beyond int32 (Knuth's 2654435761): int64 arithmetic JAX cannot hold."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(97, 4)

    def forward(self, ids):
        return self.emb((ids * 2654435761 + 12345) % 97).pow(2).mean()


def test_an_int64_constant_beyond_int32_names_the_op_and_the_line():
    model = _Hashed()
    ids = torch.randint(0, 100000, (8, 3))
    with pytest.raises(LoweringError, match=r"(?s)aten.mul.Tensor\(int64\[8, 3\]\).*integer constant is outside int32's "
                                        r"range.*x64 off.*data pipeline.*test_step_faults.py:\d+"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=ids)


def test_check_inputs_false_turns_the_check_off_and_the_nonfinite_check_still_names_the_embedding():
    model = _gpt2()
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_batch(),
                              check_inputs=False)
    # the lowered embedding reads an out-of-range row as nan (jnp.take's fill mode): the second guard catches it
    with pytest.raises(NonFiniteError, match=r"(?s)aten\.embedding\.default.*transformer\.wte.*self\.wte\(input_ids\)"):
        engine.step(_batch(input_ids=((1, 3), 9999)))


# --- non-finite losses and gradients -----------------------------------------------------------------------


class Regression(torch.nn.Module):
    """``mse(fc(log(x)·s), y)`` in two pipeline layers: a batch with x ≤ 0 makes ``log`` produce nan/inf at a
    known line."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.log(x) * self.scale  # the nan of a negative x comes from this line
        h = torchpar.mark_pipeline_boundary(h)
        return torch.nn.functional.mse_loss(self.fc(h), y)


LOG_LINE = "h = torch.log(x) * self.scale"


def _regression_batch(x_value: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    x = torch.rand(8, 4, generator=generator) + 0.5
    if x_value is not None:
        x[3, 1] = x_value
    return x, torch.randn(8, 2, generator=generator)


NONFINITE_CASES = [
    Case("nan_in_batch", lambda: _regression_batch(float("nan")), NonFiniteError,
         ("step 1", "batch[0] holds 1 nan of 32 values", "update was skipped")),
    Case("inf_in_batch", lambda: _regression_batch(float("inf")), NonFiniteError, ("batch[0] holds 1 inf",)),
    Case("op_produces_nan", lambda: _regression_batch(-1.0), NonFiniteError,
         ("aten.log.default", "produced 1 nan", LOG_LINE, "test_step_faults.py")),
    Case("op_produces_inf", lambda: _regression_batch(0.0), NonFiniteError,
         ("aten.log.default", "produced 1 inf", LOG_LINE)),
]


@pytest.mark.parametrize("method", [None, "data_parallel"])
@pytest.mark.parametrize("case", NONFINITE_CASES, ids=[c.id for c in NONFINITE_CASES])
def test_nonfinite_steps_raise_naming_the_culprit_and_keep_the_state(case, method):
    torch.manual_seed(0)
    model = Regression()
    parallel = torchpar.DataParallel(mesh_shape=(1, 2)) if method else None
    engine = torchpar.compile(model, torch.optim.Adam(model.parameters(), lr=0.01),
                              example_batch=_regression_batch(), method=parallel)
    engine.step(_regression_batch())
    before = engine.state_dict()
    with pytest.raises(case.error) as info:
        engine.step(case.batch())
    for words in case.words:
        assert words in str(info.value), f"{words!r} not in:\n{info.value}"
    after = engine.state_dict()
    for name, value in before["params"].items():
        torch.testing.assert_close(after["params"][name], value, rtol=0, atol=0)
    for name, entries in before["optimizer"].items():
        for key, value in entries.items():
            torch.testing.assert_close(after["optimizer"][name][key], value, rtol=0, atol=0)
    assert info.value.step == 1
    assert np.isfinite(engine.step(_regression_batch()))  # the run goes on from the intact state


@pytest.mark.parametrize("method", [None, "data_parallel"])
def test_a_diverging_run_raises_at_the_first_nonfinite_step_and_names_it(method):
    model = _gpt2()
    parallel = torchpar.DataParallel(mesh_shape=(1, 2)) if method else None
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=1e3), example_batch=_batch(),
                              method=parallel)
    losses = []
    with pytest.raises(NonFiniteError) as info:
        for _ in range(20):
            losses.append(engine.step(_batch()).item())
    message = str(info.value)
    assert re.search(rf"step {len(losses)} produced a non-finite (loss|gradients)", message), message
    assert "first culprit" in message and "lower learning rate" in message
    assert all(np.isfinite(losses)) and losses[-1] > 10 * losses[0]


def _skip_mode_engine(method):
    torch.manual_seed(0)
    model = Regression()
    return model, torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   example_batch=_regression_batch(), method=method, on_nonfinite="skip")


@pytest.mark.parametrize("method", [None, torchpar.PipeshardParallel(
    num_micro_batches=2, layer_option="manual", stage_option=torchpar.ManualStageOption(
        forward_stage_layer_ids=((0,), (1,)), submesh_physical_shapes=((1, 4), (1, 4)),
        submesh_logical_shapes=((1, 4), (1, 4))))], ids=["one_device", "pipeline"])
def test_skip_mode_skips_like_grad_scaler_and_counts(method, caplog):
    model, engine = _skip_mode_engine(method)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in (_regression_batch(), _regression_batch(-1.0), _regression_batch()):
        loss = reference(*batch)
        ref_opt.zero_grad()
        loss.backward()
        if all(torch.isfinite(p.grad).all() for p in reference.parameters()) and torch.isfinite(loss):
            ref_opt.step()  # GradScaler's rule: a step with inf/nan gradients is skipped
        ours = engine.step(batch)
        assert np.isfinite(ours) == bool(torch.isfinite(loss))
    assert engine.skipped_steps == 1
    assert "update was skipped" in caplog.text
    engine.sync_to_torch()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_ignore_mode_applies_the_step_as_pytorch_does():
    torch.manual_seed(0)
    model = Regression()
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_regression_batch(),
                              on_nonfinite="ignore")
    assert np.isnan(engine.step(_regression_batch(-1.0)))
    engine.sync_to_torch()
    assert not torch.isfinite(model.fc.weight).all()  # PyTorch's own result: the nan reached the weights
    assert engine.skipped_steps == 0


# --- options, models and resources ---------------------------------------------------------------------------


def _compile_tiny(**kwargs: Any) -> Any:
    model = kwargs.pop("model", None) or Regression()
    optimizer = kwargs.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    return torchpar.compile(model, optimizer, example_batch=kwargs.pop("example_batch", _regression_batch()),
                            **kwargs)


OPTION_CASES = [
    Case("on_nonfinite_unknown", lambda: _compile_tiny(on_nonfinite="explode"), ValueError,
         ("on_nonfinite must be one of", "explode")),
    Case("check_inputs_not_bool", lambda: _compile_tiny(check_inputs="yes"), TypeError, ("check_inputs",)),
    Case("model_not_a_module", lambda: torchpar.compile(lambda x: x, torch.optim.SGD([torch.nn.Parameter(
        torch.zeros(1))], lr=0.1), example_batch=torch.zeros(1)), TypeError, ("torch.nn.Module",)),
    Case("method_of_wrong_type", lambda: _compile_tiny(method="data_parallel"), TypeError,
         ("method must be None, a torchpar parallel method or a Plan", "str")),
    Case("unsupported_optimizer", lambda: _compile_tiny(optimizer=torch.optim.SparseAdam(Regression().parameters())),
         NotImplementedError, ("SparseAdam", "SGD", "RMSprop")),
    Case("micro_batches_do_not_divide_the_batch", lambda: _compile_tiny(
        method=torchpar.PipeshardParallel(num_micro_batches=3)), ValueError, ("cannot be split into 3",)),
    Case("infeasible_memory_budget", lambda: _compile_tiny(method=torchpar.ShardParallel(memory_budget=64)),
         ValueError, ("no sharding plan fits", "budget")),
    Case("loss_not_found", lambda: _compile_tiny(model=torch.nn.Linear(4, 2), example_batch=torch.randn(2, 4)),
         ValueError, ("loss_fn",)),
]


@pytest.mark.parametrize("case", OPTION_CASES, ids=[c.id for c in OPTION_CASES])
def test_bad_options_and_models_are_named(case):
    with pytest.raises(case.error) as info:
        case.batch()
    for words in case.words:
        assert words in str(info.value), f"{words!r} not in:\n{info.value}"


def test_device_out_of_memory_names_the_stage_estimate_and_remedies(monkeypatch):
    """Injected: XLA's RESOURCE_EXHAUSTED from the step (a CPU has no device memory limit to hit)."""
    import jax

    engine = _compile_tiny()
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.5GiB.")

    def raise_oom(*args: Any, **kwargs: Any) -> Any:
        raise oom

    monkeypatch.setattr(engine.executor, "step", raise_oom)
    with pytest.raises(DeviceMemoryError) as info:
        engine.step(_regression_batch())
    message = str(info.value)
    for words in ("ran out of memory while running step 0", "17.5GiB", "stage 0 on device(s) 0",
                  "the plan estimated", "each device has", "Zero3Parallel", "num_micro_batches"):
        assert words in message, f"{words!r} not in:\n{message}"
    assert info.value.__cause__ is oom


def test_an_example_batch_passing_one_tensor_twice_still_reads_each_entry():
    """``{"input_ids": ids, "labels": ids}`` made torch.export fold both entries into one graph input: a later
    batch with other labels silently trained on its input ids as labels."""
    model = _gpt2()
    reference = copy.deepcopy(model)
    ids = _batch()["input_ids"]
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              example_batch={"input_ids": ids, "labels": ids})
    shifted = {"input_ids": ids, "labels": torch.roll(ids, 1, dims=1)}
    expected = reference(**shifted).loss.item()
    assert engine.step(shifted) == pytest.approx(expected, rel=1e-5)


def _checkpoint_of(engine):
    state = engine.state_dict()
    return {**state, "params": dict(state["params"]), "optimizer": {n: dict(e) for n, e in state["optimizer"].items()}}


CHECKPOINT_CASES = [
    ("not_a_dict", lambda sd: [sd], ("a checkpoint is the dict engine.state_dict() returns", "list")),
    ("missing_section", lambda sd: {k: v for k, v in sd.items() if k != "optimizer"}, ("lacks ['optimizer']",)),
    ("another_model", lambda sd: {**sd, "params": {"encoder.weight": torch.zeros(2)}},
     ("parameters differ from the model's", "missing ['fc.bias'", "not in the model ['encoder.weight']")),
    ("wrong_shape", lambda sd: {**sd, "params": {**sd["params"], "fc.weight": torch.zeros(3, 4)}},
     ("checkpoint parameter fc.weight is torch.float32[3, 4], the model's is torch.float32[2, 4]",)),
    ("wrong_dtype", lambda sd: {**sd, "params": {**sd["params"], "scale": sd["params"]["scale"].double()}},
     ("checkpoint parameter scale is torch.float64[4]",)),
    ("another_optimizer", lambda sd: {**sd, "optimizer": {n: {} for n in sd["optimizer"]}},
     ("optimizer state of", "lacks ['exp_avg', 'exp_avg_sq']", "another optimizer")),
]


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_wrong_checkpoints_are_refused_before_anything_changes(case):
    _, corrupt, words = case
    torch.manual_seed(0)
    model = Regression()
    engine = torchpar.compile(model, torch.optim.Adam(model.parameters(), lr=0.01), example_batch=_regression_batch())
    engine.step(_regression_batch())
    good = _checkpoint_of(engine)
    with pytest.raises(ValueError) as info:
        engine.load_state_dict(corrupt(good))
    for word in words:
        assert word in str(info.value), f"{word!r} not in:\n{info.value}"
    engine.load_state_dict(good)  # the engine is intact and still loads a good one
    assert np.isfinite(engine.step(_regression_batch()))
