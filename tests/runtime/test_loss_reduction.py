"""Micro-batched steps train exactly like the whole batch, whatever the loss's reduction (``torchpar.ir.loss_parts``,
``torchpar.runtime.micro_batch_loss``): ``reduction="sum"`` (the whole batch's loss is the sum of the micro-batches'),
``"mean"``, and token-mean cross-entropy with uneven ``-100`` counts per micro-batch (``Σ nll / Σ count``, not the
mean of micro-batch means — the classic LM fine-tuning bug), against PyTorch's step on the whole batch, for gradient
accumulation (DataParallel, ShardParallel, per-device and GSPMD steps), data replicas of a ``(data, d0, d1)`` mesh
(each replica's rows a consecutive block, its gradients combined once as the whole batch's loss says) and 2-stage
pipelines."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torchpar
from torchpar.capture.export import capture_train_step
from torchpar.harness import zoo
from torchpar.ir.batch_rows import row_states
from torchpar.ir.loss_parts import LOSS_DEN, NotDecomposable, decompose_loss, loss_reduction, with_loss_parts


@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    """The session's local cluster of 8 devices, whatever an earlier module of this worker left."""
    torchpar.init(cluster="local", num_devices=8)


STEPS = 3
RTOL = ATOL = 1e-6  # fp32; measured ≤ 2e-7: only the order of the float32 sums differs from the whole batch
ROWS, WIDTH, VOCAB, SEQ = 16, 8, 16, 6


class MLP(torch.nn.Module):
    """Two linear layers, a pipeline boundary between them, MSE with the given reduction."""

    def __init__(self, reduction: str):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, 16)
        self.fc2 = torch.nn.Linear(16, WIDTH)
        self.reduction = reduction

    def forward(self, x, y):
        h = torchpar.mark_pipeline_boundary(torch.relu(self.fc1(x)))
        return F.mse_loss(self.fc2(h), y, reduction=self.reduction)


class TokenModel(torch.nn.Module):
    """Embedding → boundary → LM head, token-mean cross-entropy ignoring ``-100``. ``style="hf"`` divides the summed
    loss by a count taken before the boundary (``loss.sum() / num_items``), so stage 0 computes the denominator."""

    def __init__(self, style: str = "torch"):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.style = style

    def forward(self, ids, labels):
        num_items = (labels != -100).sum()
        h = torchpar.mark_pipeline_boundary(self.embed(ids))
        logits = self.head(torch.tanh(h)).flatten(0, 1)
        if self.style == "hf":
            return F.cross_entropy(logits, labels.flatten(), reduction="sum") / num_items
        return F.cross_entropy(logits, labels.flatten())


def _mlp_batch():
    torch.manual_seed(0)
    return torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)


def _token_batch():
    """Uneven ``-100`` counts per row; rows 0–4, 8 and 12 all ignored, so with 4 micro-batches the first one has no
    token left both when micro-batches take every 4th row (accumulation) and 4 consecutive rows (pipelines)."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ))
    labels = torch.randint(0, VOCAB, (ROWS, SEQ))
    for row in range(ROWS):
        labels[row, : row % (SEQ - 1)] = -100
    labels[[0, 1, 2, 3, 4, 8, 12]] = -100
    return ids, labels


LOSSES = {
    "sum": (lambda: MLP("sum"), _mlp_batch, 0.002),  # a smaller step: the summed loss's gradient is 16× a mean's
    "mean": (lambda: MLP("mean"), _mlp_batch, 0.1),
    "token-mean": (lambda: TokenModel(), _token_batch, 0.5),
}


def _whole_batch_steps(model, batch, lr):
    """PyTorch's truth: STEPS steps on the whole batch. → (losses, parameters)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


def _assert_trains_like_the_whole_batch(loss_name, method, **options):
    make_model, make_batch, lr = LOSSES[loss_name]
    torch.manual_seed(1)
    model, batch = make_model(), make_batch()
    reference = copy.deepcopy(model)
    ref_losses, ref_params = _whole_batch_steps(reference, batch, lr)
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), example_batch=batch,
                              method=method, **options)
    with engine:
        losses = [engine.step(batch).item() for _ in range(STEPS)]
        engine.sync_to_torch()
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    for name, value in model.named_parameters():
        torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL, msg=name)


def test_the_token_batch_shows_the_bug():
    """The mean of the micro-batches' token means is not the whole batch's token mean on this batch (every 4th row or
    consecutive rows), by far more than the tolerance."""
    ids, labels = _token_batch()
    torch.manual_seed(1)
    model = TokenModel()
    whole = model(ids, labels).item()
    for micro in (2, 4):
        rows = ROWS // micro
        strided = [slice(m, None, micro) for m in range(micro)]
        consecutive = [slice(m * rows, (m + 1) * rows) for m in range(micro)]
        for split in (strided, consecutive):
            means = [model(ids[part], labels[part]) for part in split]
            finite = [loss.item() for loss in means if torch.isfinite(loss)]
            assert abs(sum(finite) / micro - whole) > 1e-3 * whole


ONE_STAGE = {
    "dp": lambda m: torchpar.DataParallel(mesh_shape=(1, 4), num_micro_batches=m),
    "shard": lambda m: torchpar.ShardParallel(mesh_shape=(2, 2), num_micro_batches=m),
}


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("micro", [2, 4])
@pytest.mark.parametrize("method", list(ONE_STAGE))
def test_gradient_accumulation_trains_like_the_whole_batch(method, micro, loss_name):
    _assert_trains_like_the_whole_batch(loss_name, ONE_STAGE[method](micro))


def test_the_gspmd_step_accumulates_a_token_mean_like_the_whole_batch():
    _assert_trains_like_the_whole_batch("token-mean", torchpar.ShardParallel(mesh_shape=(1, 4), num_micro_batches=4),
                                        spmd="gspmd")


@pytest.mark.parametrize(("loss_name", "micro"), [("token-mean", 1), ("token-mean", 2), ("sum", 1), ("mean", 2)])
def test_data_replicas_train_like_the_whole_batch(loss_name, micro):
    """``mesh_shape=(2, 2, 2)``: two replicas of a 2 × 2 plan, rows 0–7 and 8–15 (the token batch's replicas hold
    15 and 24 of its tokens): the token mean weighs each replica by its count, a sum adds, a mean averages."""
    method = torchpar.ShardParallel(mesh_shape=(2, 2, 2), num_micro_batches=micro)
    _assert_trains_like_the_whole_batch(loss_name, method)


def _pipeline(micro: int, schedule: str = "1f1b") -> torchpar.PipeshardParallel:
    stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                        submesh_physical_shapes=((1, 4), (1, 4)),
                                        submesh_logical_shapes=((1, 4), (1, 4)))
    return torchpar.PipeshardParallel(num_micro_batches=micro, layer_option="manual", stage_option=stages,
                                      schedule=schedule)


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("micro", [2, 4])
def test_a_pipeline_trains_like_the_whole_batch(micro, loss_name):
    _assert_trains_like_the_whole_batch(loss_name, _pipeline(micro))


def test_a_pipeline_divides_by_a_count_an_earlier_stage_takes_and_clips_the_whole_batch_gradient():
    """``loss.sum() / num_items`` with ``num_items`` computed in stage 0: the count travels to the last stage; the
    update and the global-norm clipping see the whole batch's gradient (ZB-H1's split backward too)."""
    torch.manual_seed(1)
    model, batch = TokenModel(style="hf"), _token_batch()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = reference(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        optimizer.step()
        ref_losses.append(loss.item())
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.5), example_batch=batch,
                              method=_pipeline(4, "zb_h1"), grad_clip_norm=0.05)
    with engine:
        stages = engine.executor.spec.stage_graphs
        assert loss_reduction(stages[-1].graph).kind == "ratio" and stages[0].activation_outputs
        losses = [engine.step(batch).item() for _ in range(STEPS)]
        engine.sync_to_torch()
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    for name, value in model.named_parameters():
        torch.testing.assert_close(value, dict(reference.named_parameters())[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("method", ["dp", "pipeline"])
def test_fp16_loss_scaling_accumulates_like_the_whole_batch(method):
    """The fp16 path (dynamic loss scaling): 4 micro-batches train like one whole batch of the same engine."""
    results = []
    for micro in (1, 4):
        torch.manual_seed(1)
        model, batch = TokenModel(), _token_batch()
        chosen = _pipeline(micro) if method == "pipeline" else ONE_STAGE["dp"](micro)
        engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.5), example_batch=batch,
                                  method=chosen, mixed_precision="fp16")
        with engine:
            losses = [engine.step(batch).item() for _ in range(STEPS)]
            engine.sync_to_torch()
        results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (whole_losses, whole_params), (losses, params) = results
    torch.testing.assert_close(losses, whole_losses, rtol=2e-3, atol=0)
    for name, value in params.items():
        torch.testing.assert_close(value, whole_params[name], rtol=2e-3, atol=2e-4, msg=name)


# --- the graph pass --------------------------------------------------------------------------------------


def _graph(model, batch):
    return capture_train_step(model, batch).graph


class _Scaled(TokenModel):
    def forward(self, ids, labels):
        return 0.5 * super().forward(ids, labels).float() + 0.01 * (self.head.weight ** 2).sum()


class _MaxLoss(MLP):
    def forward(self, x, y):
        return (self.fc2(torch.relu(self.fc1(x))) - y).abs().max()


class _DividedByParameters(MLP):
    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return ((out - y) ** 2).sum() / (out.abs().sum() + 1)


class _BatchMeanPenalty(MLP):
    """A sum over features of the squared batch-mean output: a sum, but not of per-row terms."""

    def forward(self, x, y):
        return (self.fc2(torch.relu(self.fc1(x))).mean(0) ** 2).sum()


class _RowsThroughViews(MLP):
    """Per-row terms reached through a transpose and reshapes; the mean over dim 1 of the transposed value is a mean
    over features, not rows."""

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))                   # [rows, 8]
        per_row = out.t().reshape(2, 4, -1).mean(1)                # [2, rows]: rows moved to dim 1
        return (per_row ** 2).sum()


class _SortedAgainstTargets(MLP):
    """Rows sorted over the batch by a feature, then compared with the targets in the batch's order: each split of
    the batch would sort only its own rows and pair them with other targets."""

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return ((out[torch.argsort(out[:, 0], stable=True)] - y) ** 2).mean()


class _SortedAndPutBack(MLP):
    """Rows sorted over the batch, changed row by row, and put back in the batch's order (a mixture-of-experts
    dispatch): every row stays with its own target."""

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        order = torch.argsort(out[:, 0], stable=True)
        moved = torch.tanh(out[order])
        return ((torch.empty_like(moved).index_put((order,), moved) - y) ** 2).sum()


def test_the_pass_finds_the_loss_reduction_in_captured_graphs():
    x, y = _mlp_batch()
    ids, labels = _token_batch()
    assert decompose_loss(_graph(MLP("mean"), (x, y))).kind == "mean"
    assert decompose_loss(_graph(MLP("sum"), (x, y))).kind == "sum"
    for model in (TokenModel(), TokenModel(style="hf"), _Scaled()):  # scalar multiples and a batch-free term too
        graph = _graph(model, (ids, labels))
        reduction = decompose_loss(graph)
        assert reduction.kind == "ratio"
        den = next(n for n in graph.nodes if n.name == reduction.den)
        assert den.out.shape == () and not den.out.dtype.startswith("float") or den.target == "aten._to_copy.default"
    with pytest.raises(NotDecomposable, match="depends on the parameters"):
        decompose_loss(_graph(_DividedByParameters("sum"), (x, y)))
    # a reduction over the rows before the last one (a penalty on the batch's mean): not a sum of per-row terms
    with pytest.raises(NotDecomposable, match=r"already mix the batch's rows: aten.mean.dim .* at .*test_loss_reduction"):
        decompose_loss(_graph(_BatchMeanPenalty("sum"), (x, y)))
    assert decompose_loss(_graph(_RowsThroughViews("sum"), (x, y))).kind == "sum"
    # a sort over the batch's rows: harmless while each row stays with itself, not when it meets another row's target
    with pytest.raises(NotDecomposable, match=r"aten.sub.Tensor .* pairs rows sorted over the batch"):
        decompose_loss(_graph(_SortedAgainstTargets("mean"), (x, y)))
    assert decompose_loss(_graph(_SortedAndPutBack("sum"), (x, y))).kind == "sum"


@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_the_rows_are_followed_through_whole_models(family):
    """The pass follows the batch's rows through (nearly) every op of a zoo transformer — a KV cache's concatenation
    onto an empty tensor, a class token concatenated along the sequence, a patch-embedding convolution — so a mixing
    anywhere would be seen; and it finds none (the loss is a token-count ratio)."""
    model, batch = zoo.build(family)
    graph = capture_train_step(model, batch).graph
    states = row_states(graph)
    followed = sum(states[node.name].rows is not None for node in graph.nodes) / len(graph.nodes)
    assert followed > 0.95, followed  # 34 % (GPT-2) and 21 % (ViT) before cat and convolution were followed
    assert decompose_loss(graph).kind == "ratio"


def test_the_mark_is_an_output_and_a_mean_needs_none():
    x, y = _mlp_batch()
    graph = _graph(MLP("sum"), (x, y))
    marked = with_loss_parts(graph)
    assert [o.kind for o in marked.outputs] == [o.kind for o in graph.outputs] + [LOSS_DEN]
    assert marked.nodes == graph.nodes and loss_reduction(marked).kind == "sum"
    mean = _graph(MLP("mean"), (x, y))
    assert with_loss_parts(mean) is mean


def test_one_micro_batch_leaves_the_graph_as_captured():
    model, batch = MLP("sum"), _mlp_batch()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                          method=torchpar.DataParallel(mesh_shape=(1, 4))) as engine:
        assert [o.kind for o in engine.graph.outputs] == ["loss"]


def test_an_undecomposable_loss_warns_and_averages_the_micro_batch_losses():
    model, batch = _MaxLoss("mean"), _mlp_batch()
    with pytest.warns(UserWarning, match=r"cannot be split .*aten\.max\.default.*End the loss with a mean, a sum"):
        engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                                  method=torchpar.DataParallel(mesh_shape=(1, 4), num_micro_batches=2))
    with engine:
        micro_maxima = [model(batch[0][m::2], batch[1][m::2]).item() for m in range(2)]
        assert engine.step(batch) == pytest.approx(sum(micro_maxima) / 2, rel=1e-6)


def test_a_micro_batch_with_every_token_ignored_is_no_nonfinite_culprit():
    """Its ``0/0`` loss is left out of the step's (the step is finite, as the whole batch's is); the diagnostic
    re-run does not blame its division either."""
    model, batch = TokenModel(), _token_batch()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                          method=torchpar.DataParallel(mesh_shape=(1, 4), num_micro_batches=4)) as engine:
        expected = model(*batch).item()  # before the step: afterwards the model shows the updated weights
        assert engine.step(batch) == pytest.approx(expected, rel=RTOL)
        assert "did not reproduce" in engine.locate_nonfinite(batch)
