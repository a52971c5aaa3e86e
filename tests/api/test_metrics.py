"""``engine.last_metrics`` (:mod:`torchpar.metrics`): the rates are the step's counts over its wall time, the model
FLOPs of the IR agree with the analytic transformer count, MFU is its stated formula, ``on_metrics`` sees every
step and ``log_every`` logs."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

import torchpar
from torchpar import metrics
from torchpar.cluster import ClusterSpec, current_cluster

LAYERS, WIDTH, HEADS, VOCAB = 2, 64, 4, 256
BATCH, SEQ = 4, 32


@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    """The session's local cluster of 8 devices, whatever an earlier module of this worker left."""
    torchpar.init(cluster="local", num_devices=8)


@pytest.fixture(scope="module")
def gpt2():
    """A 2-layer GPT-2 on one device, logging every 2 steps and recording every step's metrics."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS,
                                                                 vocab_size=VOCAB, n_positions=SEQ))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    batch = {"input_ids": ids, "labels": ids}
    seen: list[metrics.StepMetrics] = []
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch,
                              log_every=2, on_metrics=seen.append)
    before_any_step = engine.last_metrics
    yield model, engine, batch, seen, before_any_step
    engine.close()


def test_no_metrics_before_the_first_step(gpt2):
    assert gpt2[-1] is None


def test_callback_sees_every_step_and_the_log_every_other(gpt2, caplog):
    _, engine, batch, seen, _ = gpt2
    before = len(seen)
    with caplog.at_level(logging.INFO, logger="torchpar.metrics"):
        losses = [engine.step(batch).item() for _ in range(4)]
    assert [m.loss for m in seen[before:]] == losses
    assert [m.step for m in seen[before:]] == list(range(before + 1, before + 5))
    assert seen[-1] is engine.last_metrics
    lines = [r.getMessage() for r in caplog.records if r.name == "torchpar.metrics"]
    assert len(lines) == 2 and all("MFU" in line and "tokens/s" in line for line in lines)
    assert lines[-1].startswith(f"torchpar: step {seen[-1].step} | loss ")


def test_rates_are_counts_over_the_step_time(gpt2):
    _, engine, batch, _, _ = gpt2
    engine.step(batch)
    m = engine.last_metrics
    assert m.samples == BATCH and m.tokens == BATCH * SEQ
    assert m.step_time_s > 0
    assert m.tokens_per_s == m.tokens / m.step_time_s
    assert m.samples_per_s == m.samples / m.step_time_s
    assert m.memory_bytes is not None and m.memory_bytes[0] > 0
    assert {"capture", "xla_compile"} <= set(m.compile_timings)
    assert m.loss_scale is None and not m.update_skipped and not m.recompiled
    assert m.as_dict()["tokens"] == BATCH * SEQ and m.scalars()["memory_bytes/0"] == m.memory_bytes[0]


def test_model_flops_match_the_transformer_count(gpt2):
    """GPT-2's matrix products per token, forward: each layer's c_attn (d → 3d), attention c_proj (d → d), MLP
    (d → 4d → d), i.e. 2·12d² FLOPs, plus the attention scores and mix, 2·2·S·d (the full S×S matrix), plus the
    LM head, 2·d·V (tied to the token embedding, whose lookup multiplies nothing); ×3 for forward + backward."""
    model, engine, batch, _, _ = gpt2
    engine.step(batch)
    tokens = BATCH * SEQ
    exact = 3 * tokens * (LAYERS * (2 * 12 * WIDTH**2 + 2 * 2 * SEQ * WIDTH) + 2 * WIDTH * VOCAB)
    assert engine.last_metrics.model_flops_per_step == exact
    # the usual estimate 6·N·T + 12·L·d·S·T, N = every parameter but the position table (a lookup; the token table
    # is the LM head's weight): its biases and norms are not products, so it is a little above
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    estimate = 6 * n * tokens + 12 * LAYERS * WIDTH * SEQ * tokens
    assert engine.last_metrics.model_flops_per_step == pytest.approx(estimate, rel=0.1)


def test_mfu_is_model_flops_over_time_and_peak(gpt2):
    _, engine, batch, _, _ = gpt2
    engine.step(batch)
    m = engine.last_metrics
    assert m.precision == "fp32" and m.num_devices == 1
    # no preset and the nominal device_flops: no real peak, so no MFU (a ratio to a made-up figure would mislead)
    assert current_cluster().preset is None and m.peak_flops_per_device is None and m.mfu is None
    assert "MFU n/a" in metrics.format_line(m)
    peak = 1e12  # a peak given by hand (or a preset's) is taken as real
    assert metrics.mfu(m.model_flops_per_step, m.step_time_s, peak, 1) == m.model_flops_per_step / m.step_time_s / peak


def test_data_parallel_fp16_metrics_count_the_devices_and_the_loss_scale():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    batch = (torch.randn(8, 16), torch.randn(8, 1))
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                          step_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1]),
                          method=torchpar.DataParallel(mesh_shape=(1, 4)), mixed_precision="fp16") as engine:
        engine.step(batch)
        m = engine.last_metrics
    assert m.num_devices == 4 and m.precision == "fp16" and m.loss_scale == 2.0**16
    assert m.samples == 8 and m.tokens is None
    assert m.model_flops_per_step == 3 * 2 * 8 * (16 * 32 + 32 * 1)


def test_peak_flops_follow_the_preset_and_precision():
    h100 = ClusterSpec.from_preset("h100-nvlink")
    assert metrics.peak_flops_per_device(h100, "bf16") == 989.4e12
    assert metrics.peak_flops_per_device(h100, "tf32") == 494.7e12
    assert metrics.peak_flops_per_device(h100, "fp32") == 67e12
    v100 = ClusterSpec.from_preset("v100-16g")
    assert metrics.peak_flops_per_device(v100, "bf16") == 15.7e12  # no bf16 units: its fp32 peak
    by_hand = ClusterSpec.from_preset("h100-nvlink", device_flops=5e14)
    assert metrics.peak_flops_per_device(by_hand, "bf16") == 5e14
    assert metrics.peak_flops_per_device(ClusterSpec(device_flops=1e12), "bf16") == 1e12
    assert metrics.peak_flops_per_device(ClusterSpec(), "bf16") is None  # the nominal default is no peak


def test_step_precision_rule():
    assert metrics.step_precision("bf16", "highest", ["float32"]) == "bf16"
    assert metrics.step_precision(None, "high", ["float32"]) == "tf32"
    assert metrics.step_precision(None, "highest", ["bfloat16", "bfloat16"]) == "bf16"
    assert metrics.step_precision(None, "highest", ["float16"]) == "fp16"
    assert metrics.step_precision(None, "medium", ["float32", "bfloat16"]) == "bf16"
    assert metrics.step_precision(None, "highest", ["float32", "bfloat16"]) == "fp32"


def test_token_rule():
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert metrics.count_tokens({"attention_mask": torch.ones(2, 7, dtype=torch.long), "input_ids": ids}) == 10
    assert metrics.count_tokens((ids, ids)) == 10
    assert metrics.count_tokens((torch.randn(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))) is None
    assert metrics.count_tokens(torch.randn(4, 8)) is None
    assert metrics.count_tokens(torch.ones(4, 8, dtype=torch.bool)) is None


def test_bad_metric_options_are_errors():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="log_every must be an int ≥ 0"):
        torchpar.compile(model, optimizer, example_batch=torch.randn(4, 2), log_every=-1)
    with pytest.raises(TypeError, match="on_metrics must be a callable"):
        torchpar.compile(model, optimizer, example_batch=torch.randn(4, 2), on_metrics="tensorboard")


def test_log_every_prints_to_stderr_when_logging_is_not_set_up(capsys, monkeypatch):
    """A bare script (no logging configured: no handler on the metrics logger or its ancestors) still sees the line;
    once logging is configured the line goes through it instead (the test above)."""
    from torchpar import metrics
    monkeypatch.setattr(logging.getLogger("torchpar.metrics"), "propagate", False)
    metrics._announce("torchpar: step 2 | loss 1.0")
    assert "torchpar: step 2 | loss 1.0" in capsys.readouterr().err
