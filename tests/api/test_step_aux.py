"""What ``engine.step`` returns: the whole batch's loss as a 0-d CPU tensor, and with a ``step_fn`` that returns
``(loss, aux)`` the pair ``(loss, aux)``, each aux value the whole batch's however the step cuts the batch
(``torchpar.ir.aux_parts``): an accuracy (a mean over rows), per-row tensors (rows in batch order), an LSTM's hidden
state carried into the next batch (truncated BPTT) — on one device, DataParallel, a 2-stage pipeline (aux values from
either stage), gradient accumulation, data replicas and 2 Ray host actors, against PyTorch eager. Bad returns and aux
values with no exact rule are refused at compile."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torchpar
from tests.runtime.ray_helpers import ray_cluster

RTOL = ATOL = 1e-6
CLIP = 0.5
BATCH, WIDTH, CLASSES = 8, 16, 4
VOCAB, EMBED, HIDDEN, SEQ = 16, 8, 8, 3

pytestmark = pytest.mark.filterwarnings("ignore:The tensor attributes self.model.rnn._flat_weights")  # nn.LSTM export


@pytest.fixture(scope="module", autouse=True)
def four_devices():
    torchpar.init(cluster="local", num_devices=4)
    yield
    torchpar.init(cluster="local", num_devices=8)


def two_stages(num_micro_batches: int = 2, devices_per_stage: int = 2) -> torchpar.PipeshardParallel:
    """Two stages cut at the model's ``mark_pipeline_boundary``, ``devices_per_stage`` devices each."""
    shapes = ((1, devices_per_stage),) * 2
    stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)), submesh_physical_shapes=shapes,
                                        submesh_logical_shapes=shapes)
    return torchpar.PipeshardParallel(num_micro_batches=num_micro_batches, layer_option="manual", stage_option=stages)


METHODS = {
    "one_device": lambda: None,
    "data_parallel": lambda: torchpar.DataParallel(mesh_shape=(1, 4)),
    "pipeline": two_stages,
}


# --- an accuracy and per-row values --------------------------------------------------------------------------


class Classifier(torch.nn.Module):
    """Linear → tanh → boundary → linear: the logits, and each row's feature norm (computed before the boundary:
    in a pipeline's first stage)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.tanh(self.hidden(x))
        norm = features.norm(dim=1)
        return self.out(torchpar.mark_pipeline_boundary(features)), norm


def classify(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    x, y = batch
    logits, feature_norm = model(x)
    loss = F.cross_entropy(logits, y)
    return loss, {"accuracy": (logits.argmax(-1) == y).float().mean(),          # 0-d, a mean over rows
                  "row_loss": F.cross_entropy(logits, y, reduction="none"),     # per row, last stage
                  "feature_norm": feature_norm,                                 # per row, first stage
                  "correct": (logits.argmax(-1) == y).sum(),                    # 0-d int64, a sum over rows
                  "prediction": logits.argmax(-1)}                              # per row, int64


def _classifier_batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator))
            for _ in range(steps)]


def _assert_aux_equal(ours: dict, theirs: dict) -> None:
    assert list(ours) == list(theirs)  # the step_fn's keys, in its order
    for key, value in theirs.items():
        assert ours[key].device.type == "cpu" and not ours[key].requires_grad and ours[key].dtype == value.dtype, key
        torch.testing.assert_close(ours[key], value.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, key=key: f"{key}: {m}")


def _train_classifier(engine: torchpar.Engine, model: torch.nn.Module, reference: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> None:
    """Three steps of ``engine`` (compiled with ``grad_clip_norm=CLIP``) beside PyTorch eager: losses, aux values and
    parameters equal."""
    for batch in _classifier_batches():
        loss, aux = engine.step(batch)
        optimizer.zero_grad()
        expected, expected_aux = classify(reference, batch)
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
        assert loss.shape == () and loss.dtype == torch.float32 and loss.device.type == "cpu"
        assert not loss.requires_grad and float(loss) == loss.item() and f"{loss:.3f}" == f"{loss.item():.3f}"
        torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=0)
        _assert_aux_equal(aux, expected_aux)
    engine.sync_to_torch()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("method", [*METHODS, "replicas"])
def test_an_accuracy_and_per_row_values_come_back_for_the_whole_batch(method):
    """Per-row values from either pipeline stage concatenate in batch order; the accuracy and the count of correct
    rows combine as a mean and a sum over micro-batches (DataParallel's per-device accumulation, a pipeline) and data
    replicas (with GSPMD accumulation inside each)."""
    make = {**METHODS, "data_parallel": lambda: torchpar.DataParallel(mesh_shape=(1, 4), num_micro_batches=2),
            "replicas": lambda: torchpar.ShardParallel(mesh_shape=(2, 1, 2), num_micro_batches=2)}[method]
    torch.manual_seed(0)
    model = Classifier()
    reference = copy.deepcopy(model)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.5), example_batch=_classifier_batches()[0],
                          step_fn=classify, method=make(), grad_clip_norm=CLIP) as engine:
        if method == "data_parallel":  # per device, its accumulation stacking the aux values
            assert engine.spmd_mode == "shard_map"
        if method == "pipeline":  # the feature norm comes from stage 0, the rest from stage 1
            keys = [{o.target for o in stage.graph.outputs if o.kind == "aux"}
                    for stage in engine.executor.spec.stage_graphs]
            assert keys == [{"feature_norm"}, {"accuracy", "row_loss", "correct", "prediction"}]
        _train_classifier(engine, model, reference, torch.optim.SGD(reference.parameters(), lr=0.5))


# --- truncated BPTT: an LSTM's hidden state carried through aux -------------------------------------------------


class LanguageModel(torch.nn.Module):
    """Embedding → LSTM (batch first) → boundary → linear head. ``h0`` / ``c0`` are batch-first ``[B, 1, H]``; the
    final state comes back batch-first too."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, EMBED)
        self.rnn = torch.nn.LSTM(EMBED, HIDDEN, batch_first=True)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, h0, c0):
        state = (h0.transpose(0, 1).contiguous(), c0.transpose(0, 1).contiguous())
        out, (h, c) = self.rnn(self.embed(ids), state)
        return self.head(torchpar.mark_pipeline_boundary(out)), h.transpose(0, 1), c.transpose(0, 1)


def bptt_step(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    logits, h, c = model(batch["ids"], batch["h0"], batch["c0"])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
    return loss, {"h": h.detach(), "c": c.detach()}


@pytest.mark.parametrize("method", list(METHODS))
def test_truncated_bptt_carries_the_lstm_state_through_aux_like_pytorch(method):
    torch.manual_seed(0)
    model = LanguageModel()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(2)
    text = torch.randint(0, VOCAB, (BATCH, 3 * SEQ + 1), generator=generator)  # 3 windows of one stream per row

    def window(step: int, h: torch.Tensor, c: torch.Tensor) -> dict:
        ids = text[:, step * SEQ:(step + 1) * SEQ + 1]
        return {"ids": ids[:, :-1], "h0": h, "c0": c, "labels": ids[:, 1:]}

    zeros = torch.zeros(BATCH, 1, HIDDEN)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.5), example_batch=window(0, zeros, zeros),
                          step_fn=bptt_step, method=METHODS[method]()) as engine:
        h, c = ref_h, ref_c = zeros, zeros
        for step in range(3):
            loss, aux = engine.step(window(step, h, c))
            h, c = aux["h"], aux["c"]
            optimizer.zero_grad()
            expected, state = bptt_step(reference, window(step, ref_h, ref_c))
            expected.backward()
            optimizer.step()
            ref_h, ref_c = state["h"].detach(), state["c"].detach()
            torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=0)
            torch.testing.assert_close((h, c), (ref_h, ref_c), rtol=RTOL, atol=ATOL)
        engine.sync_to_torch()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


# --- refused at compile ----------------------------------------------------------------------------------------


def _shifted_prediction(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1) - logits.argmax(-1).max()


REFUSED = {
    "aux_not_a_dict": (lambda m, b: (classify(m, b)[0], [b[0].sum()]), None, TypeError,
                       ["(loss, aux) with aux a dict", "list"]),
    "aux_not_a_tensor": (lambda m, b: (classify(m, b)[0], {"lr": 0.1}), None, TypeError, ["aux['lr']", "float"]),
    "loss_not_scalar": (lambda m, b: (F.cross_entropy(m(b[0])[0], b[1], reduction="none"), {}), None, ValueError,
                        ["scalar loss", "[8]"]),
    # the mean logit of each class mixes rows: no part's value gives the whole batch's
    "mixed_rows": (lambda m, b: (classify(m, b)[0], {"mean_logit": m(b[0])[0].mean(0)}),
                   lambda: torchpar.DataParallel(mesh_shape=(1, 2), num_micro_batches=2), ValueError,
                   ["aux['mean_logit']", "2 micro-batches", "mean.dim", "mix the batch's rows"]),
    # an integer per row that depends on the other rows (an index shifted by the batch's largest) mixes them too
    "mixed_integers": (lambda m, b: (classify(m, b)[0], {"shifted": _shifted_prediction(m(b[0])[0])}), two_stages,
                       ValueError, ["aux['shifted']", "aten.max.default", "mix the batch's rows"]),
    "rows_not_first": (lambda m, b: (classify(m, b)[0], {"by_column": m(b[0])[0].t()}), two_stages, ValueError,
                       ["aux['by_column']", "not dim 0", "rows first"]),
    "largest": (lambda m, b: (classify(m, b)[0], {"top": m(b[0])[0].max()}), two_stages, ValueError,
                ["aux['top']", "not a mean or a sum"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_returns_and_aux_without_a_rule_are_refused_at_compile(case):
    step_fn, method, error, words = REFUSED[case]
    model = Classifier()
    with pytest.raises(error) as info:
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_classifier_batches()[0],
                         step_fn=step_fn, method=method() if method else None)
    for word in words:
        assert word in str(info.value), f"{word!r} not in: {info.value}"


# --- on 2 Ray host actors ----------------------------------------------------------------------------------------


def test_aux_values_from_both_pipeline_stages_on_two_ray_hosts():
    """A stage on each host actor: each stage's lead reports the aux values it computes, the driver combines them."""
    with ray_cluster(num_hosts=2, devices_per_host=1):
        torch.manual_seed(0)
        model = Classifier()
        reference = copy.deepcopy(model)
        with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.5), step_fn=classify,
                              example_batch=_classifier_batches()[0], method=two_stages(devices_per_stage=1),
                              grad_clip_norm=CLIP) as engine:
            assert [w["stages"] for w in engine.describe_workers()] == [[0], [1]]
            _train_classifier(engine, model, reference, torch.optim.SGD(reference.parameters(), lr=0.5))
