"""Training the tiny HuggingFace families of ``hf_configs`` with torchpar against PyTorch eager (fp32).

The single-device engine's acceptance checks (PyTorch semantics are the truth: ``docs/semantics.md``):

1. 20 AdamW and 20 SGD (Nesterov) steps give PyTorch's loss at every step (1e-4 relative);
2. after ``sync_to_torch`` the parameters are PyTorch's (SGD: every element; AdamW: per tensor, and
   no further from a float64 PyTorch run than PyTorch's own float32 run is, up to 10x);
3. a torch LR scheduler drives the compiled step without recompiling;
4. dropout is reproducible from ``seed``, differs across seeds, and trains like PyTorch's dropout;
5. ``engine.forward`` is the model's eval forward, in the model's output structure;
6. ``state_dict``/``load_state_dict`` (and ``torch.save``/``torch.load``) resume a run exactly;
7. ``sync_to_torch`` writes the optimizer state back, so PyTorch can continue the run;
8. a new batch shape compiles once more (and says so); a new structure or dtype is a ValueError.

Reference trajectories are chosen to be well-conditioned in float32: perturbing the initial weights by
one ulp (relative 1e-7) moves PyTorch's own 20-step loss curve by < 1e-5. On an ill-conditioned one a
1e-4 comparison measures luck, not the lowering. Two such cases exist for these configs:

- ``resnet`` with seed 0, AdamW: at step 5 one BatchNorm output feeding a ReLU is 6e-7 from zero, well
  inside the fp32 rounding of the whole forward (max error vs float64 ~4e-6 for torch and for us), so
  the ReLU's gradient switches on or off by chance; PyTorch against its own 1-ulp-perturbed init then
  differs by up to 5e-4 in loss (3 of 6 perturbations), torchpar by 4.7e-4. Seed 1 has no such event.
- SGD at lr 0.05 on ``llama`` (PyTorch vs perturbed PyTorch: loss 5e-5, ~1000 elements outside rtol
  1e-4) and on ``vit`` (loss ~1e-5 by step 20): hence the per-family ``SGD_LR``.

Engines are shared through a module-scoped fixture where a test only reads them (~50 compiles in all);
the file takes about three minutes on two CPU cores (~3.5 min of CPU time).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import warnings
from typing import Any, Callable

import pytest
import torch

import torchpar
from tests.models import hf_configs

FAMILIES = list(hf_configs.FAMILIES)
STEPS = 20
LOSS_RTOL = 1e-4
MODEL_SEED = {"resnet": 1}  # see the module docstring: seed 0 is ill-conditioned for resnet + AdamW
SGD_LR = {"gpt2": 0.02, "llama": 0.02, "bert": 0.02, "vit": 0.005, "resnet": 0.02}
ADAMW = dict(lr=1e-3, weight_decay=0.01)
ADAMW_NORM_RTOL = 2e-3  # ||p_ours - p_torch|| / ||p_torch|| per tensor, AdamW
NOISE_GRAD_NORM = 1e-7  # a tensor whose torch gradient norm stays below this is driven by round-off
F64_FACTOR, F64_FLOOR = 10.0, 1e-5


# --- building and running ----------------------------------------------------------------------------

def build(family: str, dropout: float = 0.0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The family's model and example batch, deterministic for the family's seed."""
    torch.manual_seed(MODEL_SEED.get(family, 0))
    model, batch = hf_configs.FAMILIES[family](dropout)
    return model.train(), batch


def make_optimizer(kind: str, family: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), **ADAMW)
    assert kind == "sgd", kind
    return torch.optim.SGD(model.parameters(), lr=SGD_LR[family], momentum=0.9, nesterov=True, weight_decay=1e-4)


def torch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    """One eager training step, the loop torchpar must reproduce."""
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def relative_norm_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((ours.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def loss_table(columns: dict[str, list[float]], rel: list[float] | None = None, rtol: float = LOSS_RTOL) -> str:
    """Losses per step side by side, with the relative difference of the first two columns if given."""
    names = list(columns)
    lines = ["step " + " ".join(f"{n:>14}" for n in names) + (f" {'rel. diff':>10}" if rel else "")]
    for i in range(len(columns[names[0]])):
        line = f"{i + 1:4d} " + " ".join(f"{columns[n][i]:14.8f}" for n in names)
        if rel:
            line += f" {rel[i]:10.2e}" + (f"  <-- > {rtol:.0e}" if rel[i] > rtol else "")
        lines.append(line)
    return "\n".join(lines)


def assert_losses_close(ours: list[float], ref: list[float], rtol: float = LOSS_RTOL, what: str = "") -> None:
    """Every step's loss within ``rtol`` of PyTorch's; a per-step table on failure."""
    assert len(ours) == len(ref)
    rel = [abs(o - r) / abs(r) for o, r in zip(ours, ref)]
    assert all(math.isfinite(o) for o in ours), f"{what}: non-finite torchpar loss: {ours}"
    if max(rel) > rtol:
        pytest.fail(f"{what}: loss differs from PyTorch by more than {rtol:.0e} relative\n"
                    + loss_table({"torchpar": ours, "pytorch": ref}, rel, rtol), pytrace=False)


# --- 20 steps of each optimizer, shared by the tests that only read the result ----------------------

@dataclasses.dataclass
class Trained:
    """One family trained STEPS steps with one optimizer by torchpar and by PyTorch from the same init."""

    family: str
    kind: str
    init: torch.nn.Module  # the untouched initial model
    batch: dict
    ours_losses: list[float]
    torch_losses: list[float]
    ours_params: dict[str, torch.Tensor]  # after sync_to_torch
    torch_params: dict[str, torch.Tensor]
    grad_norms: dict[str, list[float]]  # PyTorch's gradient norm per tensor per step (0.0 if no grad)
    engine: Any
    model: torch.nn.Module  # the engine's model and optimizer, synced after STEPS steps
    optimizer: torch.optim.Optimizer
    ref_model: torch.nn.Module  # PyTorch's model and optimizer after STEPS steps
    ref_optimizer: torch.optim.Optimizer

    def noise_driven(self) -> list[str]:
        return [n for n, norms in self.grad_norms.items() if max(norms) < NOISE_GRAD_NORM]


def train_both(family: str, kind: str) -> Trained:
    init, batch = build(family)
    model = copy.deepcopy(init)
    optimizer = make_optimizer(kind, family, model)
    engine = torchpar.compile(model, optimizer, example_batch=batch)
    ours = [engine.step(batch).item() for _ in range(STEPS)]
    engine.sync_to_torch()

    ref_model = copy.deepcopy(init)
    ref_optimizer = make_optimizer(kind, family, ref_model)
    grad_norms: dict[str, list[float]] = {n: [] for n, _ in ref_model.named_parameters()}
    ref = []
    for _ in range(STEPS):
        ref_optimizer.zero_grad()
        loss = ref_model(**batch).loss
        loss.backward()
        for name, p in ref_model.named_parameters():
            grad_norms[name].append(0.0 if p.grad is None else p.grad.norm().item())
        ref_optimizer.step()
        ref.append(loss.item())
    return Trained(family=family, kind=kind, init=init, batch=batch, ours_losses=ours, torch_losses=ref,
                   ours_params=params_of(model), torch_params=params_of(ref_model), grad_norms=grad_norms,
                   engine=engine, model=model, optimizer=optimizer, ref_model=ref_model,
                   ref_optimizer=ref_optimizer)


@pytest.fixture(scope="module")
def trained() -> Callable[[str, str], Trained]:
    cache: dict[tuple[str, str], Trained] = {}

    def get(family: str, kind: str) -> Trained:
        if (family, kind) not in cache:
            cache[family, kind] = train_both(family, kind)
        return cache[family, kind]

    return get


# --- 1. loss curves ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_curve_matches_pytorch(trained, family, kind):
    run = trained(family, kind)
    assert_losses_close(run.ours_losses, run.torch_losses, what=f"{family} {kind}")
    assert run.torch_losses[-1] < 0.8 * run.torch_losses[0], "the reference run should be learning"


# --- 2. parameters after sync_to_torch --------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_sgd_params_match_pytorch_elementwise(trained, family):
    run = trained(family, "sgd")
    for name, ref in run.torch_params.items():
        torch.testing.assert_close(run.ours_params[name], ref, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{family} SGD parameter {name}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_adamw_params_match_pytorch_per_tensor(trained, family, record_property):
    """||p_ours - p_torch|| <= 2e-3 ||p_torch|| per tensor, except round-off-driven tensors.

    Adam divides by sqrt(v) + 1e-8, so gradient elements near 1e-8 are amplified round-off: attention
    key biases have a mathematically zero gradient (softmax is shift-invariant) and both PyTorch and we
    update them from noise. Such tensors (torch gradient norm < 1e-7 at every step) are recorded, not
    compared; they must be key biases.
    """
    run = trained(family, "adamw")
    noise = run.noise_driven()
    record_property("noise_driven_tensors", noise)
    print(f"{family}: round-off-driven tensors (not compared): {noise}")
    assert all(n.endswith("bias") and ("key" in n or "k_proj" in n) for n in noise), noise
    errors = {n: relative_norm_error(run.ours_params[n], ref) for n, ref in run.torch_params.items() if n not in noise}
    worst = sorted(errors.items(), key=lambda kv: -kv[1])
    record_property("worst_relative_norm_error", worst[0])
    bad = [(n, e) for n, e in worst if e > ADAMW_NORM_RTOL]
    assert not bad, f"{family} AdamW: tensors with ||ours - torch|| / ||torch|| > {ADAMW_NORM_RTOL}: {bad}"


def float64_adamw_params(run: Trained) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(run.init).double().train()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in run.batch.items()}
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    for _ in range(STEPS):
        torch_step(model, optimizer, batch)
    return params_of(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_adamw_params_as_close_to_float64_as_pytorch(trained, family, record_property):
    """Against a float64 PyTorch run: our worst per-tensor error is within 10x PyTorch float32's own.

    This is the tolerance of ``test_adamw_params_match_pytorch_per_tensor`` measured rather than
    assumed: PyTorch float32 is itself ~1e-3 away from float64 on GPT-2's fused qkv bias.
    """
    run = trained(family, "adamw")
    exact = float64_adamw_params(run)
    noise = set(run.noise_driven())
    ours = {n: relative_norm_error(run.ours_params[n], exact[n]) for n in exact if n not in noise}
    theirs = {n: relative_norm_error(run.torch_params[n], exact[n]) for n in exact if n not in noise}
    ours_max, theirs_max = max(ours.values()), max(theirs.values())
    worst = max(ours, key=ours.get)
    record_property("f64_error", {"torchpar": ours_max, "pytorch_fp32": theirs_max, "worst_tensor": worst})
    print(f"{family}: max per-tensor error vs float64: torchpar {ours_max:.2e} ({worst}), "
          f"PyTorch fp32 {theirs_max:.2e}")
    assert ours_max <= F64_FACTOR * theirs_max + F64_FLOOR, (
        f"{family}: torchpar's AdamW parameters are {ours_max:.2e} (tensor {worst}) from a float64 PyTorch "
        f"run, PyTorch float32's are {theirs_max:.2e} ({theirs[worst]:.2e} on that tensor)")


# --- 3. LR scheduler -------------------------------------------------------------------------------

def warmup_then_decay(step: int) -> float:
    return min(1.0, (step + 1) / 4) * 0.8 ** max(0, step - 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_lr_scheduler_changes_lr_without_recompiling(family):
    init, batch = build(family)
    model, ref_model = copy.deepcopy(init), copy.deepcopy(init)
    optimizer, ref_optimizer = make_optimizer("adamw", family, model), make_optimizer("adamw", family, ref_model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_optimizer, warmup_then_decay)
    engine = torchpar.compile(model, optimizer, example_batch=batch)
    ours, ref, lrs = [], [], []
    with warnings.catch_warnings():  # engine.step counts as the optimizer's step for the scheduler
        warnings.filterwarnings("error", message=r"Detected call of `lr_scheduler.step\(\)`")
        for _ in range(10):
            lrs.append(optimizer.param_groups[0]["lr"])
            ours.append(engine.step(batch).item())
            scheduler.step()
            ref.append(torch_step(ref_model, ref_optimizer, batch))
            ref_scheduler.step()
    assert len(set(lrs)) == len(lrs), f"the schedule should change lr every step: {lrs}"
    assert_losses_close(ours, ref, what=f"{family} AdamW + LambdaLR")
    assert engine.compiled_signatures == 1, "changing lr must not recompile the step"


# --- 4. dropout -----------------------------------------------------------------------------------

DROPOUT_STEPS = 30


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_dropout_reproducible_per_seed_and_trains_like_pytorch(family):
    init, batch = build(family, dropout=0.1)

    def ours(seed: int) -> list[float]:
        model = copy.deepcopy(init)
        engine = torchpar.compile(model, make_optimizer("adamw", family, model), example_batch=batch, seed=seed)
        return [engine.step(batch).item() for _ in range(DROPOUT_STEPS)]

    def eager(model: torch.nn.Module) -> list[float]:
        optimizer = make_optimizer("adamw", family, model)
        return [torch_step(model, optimizer, batch) for _ in range(DROPOUT_STEPS)]

    first, again, other = ours(1), ours(1), ours(2)
    assert first == again, "the same seed must reproduce the loss curve exactly"
    assert first[0] != other[0] and first != other, "another seed must draw other dropout masks"

    torch.manual_seed(1234)
    ref = eager(copy.deepcopy(init))
    no_dropout = eager(build(family, dropout=0.0)[0])  # same weights (the config only changes dropout)
    table = loss_table({"seed 1": first, "seed 2": other, "pytorch": ref, "pytorch p=0": no_dropout})

    def drop(losses: list[float]) -> float:
        return mean(losses[:5]) - mean(losses[-5:])

    for name, losses in (("seed 1", first), ("seed 2", other)):
        assert abs(drop(losses) - drop(ref)) <= 0.1 * drop(ref), (
            f"{family} {name}: the loss falls by {drop(losses):.3f} over {DROPOUT_STEPS} steps, PyTorch's by "
            f"{drop(ref):.3f}\n{table}")
    # Dropout keeps the training loss above the p=0 curve; ours must sit where PyTorch's does.
    gap = mean(ref[-5:]) - mean(no_dropout[-5:])
    assert gap > 0.1, f"{family}: dropout 0.1 should raise the training loss visibly\n{table}"
    ours_level = (mean(first[-5:]) + mean(other[-5:])) / 2  # two independent runs
    assert abs(ours_level - mean(ref[-5:])) <= 0.25 * gap, (
        f"{family}: last-5 mean loss {ours_level:.4f}, PyTorch {mean(ref[-5:]):.4f} (without dropout "
        f"{mean(no_dropout[-5:]):.4f})\n{table}")


# --- 5. eval forward -------------------------------------------------------------------------------

# engine.forward exports with use_cache=False: no KV cache in its outputs (transformers < 5.24 names it
# past_key_values, 5.24 cache)
NOT_RETURNED = {"past_key_values", "cache"}


def assert_outputs_match(out: Any, ref: Any, what: str) -> None:
    assert type(out) is type(ref), f"{what}: output type {type(out).__name__}, model returns {type(ref).__name__}"
    expected = [key for key in ref.keys() if key not in NOT_RETURNED]
    assert list(out.keys()) == expected, f"{what}: output keys {list(out.keys())} vs {expected}"
    for key in expected:
        torch.testing.assert_close(out[key], ref[key], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{what} {key}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_torch_eval(trained, family):
    """After 20 SGD steps, ``engine.forward`` equals the synced model's eval forward (labels included, so
    ``loss`` is compared too)."""
    run = trained(family, "sgd")
    out = run.engine.forward(run.batch)
    model = copy.deepcopy(run.model).eval()
    with torch.no_grad():
        ref = model(**run.batch)
    assert_outputs_match(out, ref, family)


def _trained_and_eval_reference(init, batch, family: str, optimizer: str):
    """An engine trained 3 steps from a copy of ``init``, its synced model, and that model's eval outputs."""
    model = copy.deepcopy(init)
    engine = torchpar.compile(model, make_optimizer(optimizer, family, model), example_batch=batch)
    for _ in range(3):
        engine.step(batch)
    engine.sync_to_torch()
    with torch.no_grad():
        ref = copy.deepcopy(model).eval()(**batch)
    return engine, model, ref


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_forward_matches_torch_eval_without_cache(family):
    init, batch = build(family)
    init.config.use_cache = False
    engine, _, ref = _trained_and_eval_reference(init, batch, family, "sgd")
    assert_outputs_match(engine.forward(batch), ref, family)


@pytest.mark.parametrize("family", ["bert"])
def test_forward_is_eval_mode_with_dropout(family):
    init, batch = build(family, dropout=0.1)
    engine, model, ref = _trained_and_eval_reference(init, batch, family, "adamw")
    first = engine.forward(batch)
    assert_outputs_match(first, ref, family)
    assert torch.equal(engine.forward(batch).logits, first.logits), "eval forward must not drop out"
    assert model.training, "engine.forward must not leave the user's model in eval mode"


# --- 6. checkpoints --------------------------------------------------------------------------------

@pytest.mark.parametrize("family,dropout", [(f, 0.0) for f in FAMILIES] + [("gpt2", 0.1)])
def test_state_dict_round_trip_is_exact(family, dropout, tmp_path):
    init, batch = build(family, dropout)
    model = copy.deepcopy(init)
    engine = torchpar.compile(model, make_optimizer("adamw", family, model), example_batch=batch, seed=3)
    for _ in range(3):
        engine.step(batch)
    state = engine.state_dict()
    torch.save(state, tmp_path / "engine.pt")
    continued = [engine.step(batch).item() for _ in range(3)]
    final = engine.state_dict()

    loaded = torch.load(tmp_path / "engine.pt", weights_only=True)
    for name, value in state["params"].items():  # later steps must not write into an earlier checkpoint
        assert torch.equal(loaded["params"][name], value), f"checkpoint tensor {name} changed after it was taken"

    fresh = copy.deepcopy(init)
    resumed_engine = torchpar.compile(fresh, make_optimizer("adamw", family, fresh), example_batch=batch, seed=3)
    resumed_engine.load_state_dict(loaded)
    resumed = [resumed_engine.step(batch).item() for _ in range(3)]
    assert resumed == continued, f"{family}: resumed losses {resumed} vs uninterrupted {continued}"
    after = resumed_engine.state_dict()
    for name, value in final["params"].items():
        assert torch.equal(after["params"][name], value), f"{family}: parameter {name} differs after resuming"
    for name in final["optimizer"]:
        for key, value in final["optimizer"][name].items():
            assert torch.equal(after["optimizer"][name][key], value), f"{family}: optimizer {name}.{key} differs"


# --- 7. continuing in PyTorch after sync_to_torch ----------------------------------------------------

@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("family", FAMILIES)
def test_pytorch_continues_from_synced_state(trained, family, kind):
    run = trained(family, kind)
    model, optimizer = copy.deepcopy((run.model, run.optimizer))  # deep-copied together: state keys follow
    ref_model, ref_optimizer = copy.deepcopy((run.ref_model, run.ref_optimizer))
    stateless_model = copy.deepcopy(run.model)
    stateless = make_optimizer(kind, family, stateless_model)  # control: the same weights, no optimizer state
    ours = [torch_step(model, optimizer, run.batch) for _ in range(3)]
    ref = [torch_step(ref_model, ref_optimizer, run.batch) for _ in range(3)]
    control = [torch_step(stateless_model, stateless, run.batch) for _ in range(3)]
    assert_losses_close(ours, ref, what=f"{family} {kind}: PyTorch steps after sync_to_torch")
    assert max(abs(c - r) / abs(r) for c, r in zip(control, ref)) > 10 * LOSS_RTOL, (
        "control: without the optimizer state the continuation should differ")


# --- 8. new batch shapes and bad batches -----------------------------------------------------------

def other_shape(family: str, batch: dict) -> dict:
    """Text: sequence length 8 instead of 16. Images: half the batch."""
    if "input_ids" in batch:
        return {k: v[:, :8].contiguous() for k, v in batch.items()}
    return {k: v[: v.shape[0] // 2].contiguous() for k, v in batch.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_new_batch_shape_recompiles_once_and_matches(family, caplog):
    init, batch = build(family)
    small = other_shape(family, batch)
    model, ref_model = copy.deepcopy(init), copy.deepcopy(init)
    engine = torchpar.compile(model, make_optimizer("adamw", family, model), example_batch=batch)
    ref_optimizer = make_optimizer("adamw", family, ref_model)
    caplog.set_level(logging.INFO, logger="torchpar")
    sequence = [batch, small, small, batch, small]
    ours, recompiles = [], []
    for b in sequence:
        caplog.clear()
        ours.append(engine.step(b).item())
        recompiles.append(sum("recompil" in r.getMessage().lower() for r in caplog.records
                              if r.name.startswith("torchpar")))
    ref = [torch_step(ref_model, ref_optimizer, b) for b in sequence]
    assert recompiles == [0, 1, 0, 0, 0], f"recompile log lines per step: {recompiles}"
    assert engine.compiled_signatures == 2
    assert_losses_close(ours, ref, what=f"{family} AdamW, alternating batch shapes")


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_with_other_structure_or_dtype_is_rejected(trained, family):
    run = trained(family, "adamw")
    engine, batch = run.engine, run.batch
    missing = {k: v for k, v in batch.items() if k != "labels"}
    with pytest.raises(ValueError, match="structure"):
        engine.step(missing)
    key = "input_ids" if "input_ids" in batch else "pixel_values"
    retyped = {**batch, key: batch[key].to(torch.int32 if key == "input_ids" else torch.float64)}
    with pytest.raises(ValueError, match="dtype"):
        engine.step(retyped)
    assert engine.compiled_signatures == 1, "a rejected batch must not compile anything"
