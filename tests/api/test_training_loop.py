"""The loop around the step keeps working (issue 46): the torch model is never stale, what user code writes into it
reaches the next step, the state ``forward`` reads is honoured or refused by name, and ``.grad`` is never a silent
``None``. Every loop is run side by side with PyTorch eager (losses and every parameter within ``TOL``, fp32) on one
device, DataParallel over 4 devices and a 2-stage pipeline (2 micro-batches, one device per stage); no
``sync_to_torch()`` anywhere.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import torchpar
from tests.runtime.ray_helpers import local_cluster
from torchpar.capture.module_state import ModuleStateError

TOL = 1e-6
METHODS = ["one_device", "data_parallel", "pipeline"]


class Net(torch.nn.Module):
    """Two halves cut by a pipeline boundary; ``forward(x, y)`` returns the loss."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.first = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.second = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 1)

    @property
    def device(self) -> torch.device:  # as Hugging Face models have: loops read it at every step
        return next(self.parameters()).device

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.first(x)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torchpar.mark_pipeline_boundary(self.hidden(x))
        return F.mse_loss(self.head(torch.tanh(self.second(h))), y)


def method_of(name: str):
    if name == "one_device":
        return None
    if name == "data_parallel":
        return torchpar.DataParallel(mesh_shape=(1, 4))
    stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)), submesh_physical_shapes=((1, 1), (1, 1)),
                                        submesh_logical_shapes=((1, 1), (1, 1)))
    return torchpar.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=stages)


@contextlib.contextmanager
def cluster_for(name: str):
    """A pipeline runs on a local cluster of 2 hosts × 1 device (one device per stage); the others on the session's."""
    if name != "pipeline":
        yield
        return
    with local_cluster(num_hosts=2, devices_per_host=1) as cluster:
        yield cluster


def batches(n: int, width: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, width, generator=generator), torch.randn(16, 1, generator=generator)) for _ in range(n)]


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def torch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def assert_same(got, expected, what: str) -> None:
    torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


def assert_same_model(model: torch.nn.Module, reference: torch.nn.Module, what: str) -> None:
    got, expected = model.state_dict(), reference.state_dict()
    assert list(got) == list(expected)
    for key in expected:
        assert_same(got[key], expected[key], f"{what}: {key}")


# --- the torch model is never stale -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_evaluation_saving_and_an_ema_between_steps_see_the_engines_weights(method):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    ref_opt = sgd(reference)
    optimizer = sgd(model)
    data, held_out = batches(6), batches(1)[0]
    with cluster_for(method), torchpar.compile(model, optimizer, example_batch=data[0],
                                               method=method_of(method)) as engine:
        ema, ref_ema = (AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in (model, reference))
        for epoch in range(3):
            for batch in data[2 * epoch:2 * epoch + 2]:
                assert_same(engine.step(batch), torch_step(reference, ref_opt, batch), f"epoch {epoch} loss")
            ema.update_parameters(model)
            ref_ema.update_parameters(reference)
            with torch.no_grad():  # mnist/main.py's test(): the torch model, after each epoch
                model.eval(), reference.eval()
                assert_same(model(*held_out), reference(*held_out), f"epoch {epoch} evaluation")
                assert_same(model.first(held_out[0]), reference.first(held_out[0]), "a submodule called alone")
                model.train(), reference.train()
            if epoch == 1:  # a checkpoint saved mid-run, the PyTorch way
                saved, ref_saved = io.BytesIO(), io.BytesIO()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
                torch.save({"model": reference.state_dict(), "optimizer": ref_opt.state_dict()}, ref_saved)
        for m, r in zip(ema.parameters(), ref_ema.parameters()):
            assert_same(m, r, "EMA")
        assert_same_model(model, reference, "after training")
    saved.seek(0), ref_saved.seek(0)
    ours, theirs = torch.load(saved), torch.load(ref_saved)
    for key in theirs["model"]:
        assert_same(ours["model"][key], theirs["model"][key], f"saved {key}")
    for index, state in theirs["optimizer"]["state"].items():
        assert_same(ours["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"], "optimizer state")


def recompiles(caplog) -> int:
    return sum("recompiling the training step" in r.getMessage() for r in caplog.records)


class ConvBatchNorm(torch.nn.Module):
    """A CNN whose BatchNorm behaves differently in eval mode (running statistics) and updates them in train mode."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4 * width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x.unsqueeze(1))))
        return F.mse_loss(self.head(h.flatten(1)), y)


@pytest.mark.parametrize("net, method", [(Net, m) for m in METHODS]
                         + [(ConvBatchNorm, m) for m in ("one_device", "data_parallel")])
def test_an_evaluation_in_eval_mode_between_steps_recompiles_nothing(net, method, caplog):
    """The Hugging Face Trainer's loop: ``model.eval()``, ``engine.forward`` and a checkpoint, ``model.train()``, the
    next step. The eval forward and the save concern values only; the mode is back to the compiled one at the step.
    A step taken while still in eval mode recompiles then, once (PyTorch trains in eval mode)."""
    torch.manual_seed(0)
    model = net()
    reference = copy.deepcopy(model)
    ref_opt, optimizer = sgd(reference), sgd(model)
    data, held_out = batches(4), batches(1)[0]
    with cluster_for(method), torchpar.compile(model, optimizer, example_batch=data[0],
                                               method=method_of(method)) as engine:
        for i, batch in enumerate(data[:3]):
            assert_same(engine.step(batch), torch_step(reference, ref_opt, batch), f"step {i} loss")
            model.eval(), reference.eval()
            with torch.no_grad():
                assert_same(engine.forward(held_out), reference(*held_out), f"evaluation after step {i}")
            engine.state_dict(), engine.export_torch_state_dict()
            model.train(), reference.train()
        assert recompiles(caplog) == 0, [r.getMessage() for r in caplog.records]
        model.eval(), reference.eval()
        engine.forward(held_out)
        assert recompiles(caplog) == 0
        assert_same(engine.step(data[3]), torch_step(reference, ref_opt, data[3]), "a step in eval mode")
        assert recompiles(caplog) == 1
        assert_same_model(model, reference, "after training")


@pytest.mark.parametrize("method", ["one_device", "data_parallel"])
def test_a_loaded_optimizer_state_survives_the_recompile_of_a_setup_change(method):
    """Resuming from a checkpoint and freezing a layer in the same breath: the step recompiles for the frozen layer
    and must start from the loaded optimizer state, not from the engine's own."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    optimizer, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, reference))
    data = batches(5)
    with cluster_for(method), torchpar.compile(model, optimizer, example_batch=data[0],
                                               method=method_of(method)) as engine:
        for i, batch in enumerate(data[:2]):
            assert_same(engine.step(batch), torch_step(reference, ref_opt, batch), f"step {i} loss")
        saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        ref_saved = copy.deepcopy((reference.state_dict(), ref_opt.state_dict()))
        for i, batch in enumerate(data[2:4], 2):
            assert_same(engine.step(batch), torch_step(reference, ref_opt, batch), f"step {i} loss")
        model.load_state_dict(saved[0]), optimizer.load_state_dict(saved[1])
        reference.load_state_dict(ref_saved[0]), ref_opt.load_state_dict(ref_saved[1])
        model.head.requires_grad_(False), reference.head.requires_grad_(False)
        assert_same(engine.step(data[4]), torch_step(reference, ref_opt, data[4]), "the step after loading")
        assert_same_model(model, reference, "after the step")
        for got, expected in zip(optimizer.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
            assert_same(got["exp_avg_sq"], expected["exp_avg_sq"], "optimizer state")


def test_copies_and_pickles_of_the_linked_model_are_its_own_class_with_the_current_weights():
    torch.manual_seed(0)
    model = Net()
    batch = batches(1)[0]
    with torchpar.compile(model, sgd(model), example_batch=batch) as engine:
        engine.step(batch)
        assert model.device == torch.device("cpu") and engine._torch.link.holds()  # metadata pulls nothing
        assert type(model).__name__ == "Net" and isinstance(model, Net)
        copied = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for clone in (copied, loaded):
            assert type(clone) is Net
            assert_same_model(clone, model, "a copy")
    assert type(model) is Net  # the engine closed: the model is a plain module again
    engine = torchpar.compile(model, sgd(model), example_batch=batch)
    assert type(model) is not Net
    del engine
    gc.collect()
    assert type(model) is Net  # an engine collected without close() gives the class back too


# --- what user code writes reaches the next step ------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_loaded_scaled_and_tied_weights_are_what_the_next_step_trains(method, caplog):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    ref_opt = sgd(reference)
    other = Net().state_dict()  # e.g. a checkpoint of another run
    data = batches(7)
    writes = {
        1: lambda m: m.load_state_dict(other),
        3: lambda m: [p.mul_(0.5) for p in m.parameters()],
        5: lambda m: setattr(m.second, "weight", m.first.weight),  # tie two weights (the optimizer keeps the old one)
    }
    with cluster_for(method), torchpar.compile(model, sgd(model), example_batch=data[0],
                                               method=method_of(method)) as engine:
        for step, batch in enumerate(data):
            if step in writes:
                with torch.no_grad():
                    writes[step](model), writes[step](reference)
            assert_same(engine.step(batch), torch_step(reference, ref_opt, batch), f"step {step}")
        assert model.second.weight is model.first.weight
        assert_same_model(model, reference, "after training")
    assert "second.weight (parameter) was replaced" in caplog.text


# --- the state forward reads --------------------------------------------------------------------------------------


class Knobs(Net):
    """A loss weight, a temperature tensor and a dropout on a side branch, all read in ``forward``."""

    def __init__(self):
        super().__init__()
        self.kl_weight = 1.0
        self.temperature = torch.tensor(2.0)
        self.drop = torch.nn.Dropout(p=1.0)  # deterministic at 1.0 and at 0.0

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.first(x))) / self.temperature
        return h + self.drop(self.second(h))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.kl_weight * super().forward(x, y)


@pytest.mark.parametrize("method", METHODS)
def test_attributes_forward_reads_are_read_at_every_step(method, caplog):
    torch.manual_seed(0)
    model = Knobs()
    reference = copy.deepcopy(model)
    ref_opt = sgd(reference)
    data = batches(6)

    def change(step: int, m: Knobs) -> None:
        if step == 1:
            m.temperature = torch.tensor(3.0)  # a new tensor object: fed, no recompile
        if step == 2:
            m.temperature.fill_(0.5)  # in place: fed, no recompile
        if step == 3:  # a schedule on the model: recompiles once, with a warning naming both
            m.kl_weight = 0.25
            m.drop.p = 0.0
        if step >= 4:  # the loss weight is a step input since: annealing it recompiles no more
            m.kl_weight = 0.5 / step

    with cluster_for(method), torchpar.compile(model, sgd(model), example_batch=data[0],
                                               method=method_of(method)) as engine:
        for step, batch in enumerate(data):
            change(step, model), change(step, reference)
            assert_same(engine.step(batch), torch_step(reference, ref_opt, batch), f"step {step}")
        assert_same_model(model, reference, "after training")
    recompiles = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    assert len(recompiles) == 1, recompiles
    assert "kl_weight changed from 1.0 to 0.25" in recompiles[0] and "drop.p changed from 1.0 to 0.0" in recompiles[0]
    assert "from now on kl_weight is a step input" in recompiles[0]  # Dropout's p steers control flow


class CenteredNet(Net):
    """``forward`` reassigns a registered buffer (``self.center = ...``, not ``copy_``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("center", torch.zeros(8))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        self.center = 0.5 * self.center + 0.5 * self.first.bias.detach()
        return torch.tanh(self.norm(self.first(x) - self.center))


@pytest.mark.parametrize("method", ["one_device", "data_parallel"])
def test_a_buffer_forward_reassigns_is_carried_from_step_to_step(method):
    torch.manual_seed(0)
    model = CenteredNet()
    reference = copy.deepcopy(model)
    ref_opt = sgd(reference)
    with torchpar.compile(model, sgd(model), example_batch=batches(1)[0], method=method_of(method)) as engine:
        for step, batch in enumerate(batches(3)):
            assert_same(engine.step(batch), torch_step(reference, ref_opt, batch), f"step {step}")
        assert_same_model(model, reference, "after training")  # the buffer too
        assert model.center.abs().sum() > 0


class Counting(Net):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1  # a warm-up ramp's counter
        return min(1.0, self.calls / 10) * super().forward(x, y)


class StatefulLSTM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 8, batch_first=True)
        self.hidden_state = None

    def forward(self, x, y):
        out, self.hidden_state = self.lstm(x, self.hidden_state)
        return F.mse_loss(out[:, -1, :1], y)


@pytest.mark.parametrize("model, attribute, line", [
    (Counting, "Counting.calls", "self.calls += 1"),
    (StatefulLSTM, "StatefulLSTM.hidden_state", "out, self.hidden_state = self.lstm(x, self.hidden_state)"),
], ids=["python_counter", "lstm_hidden_state"])
def test_side_effects_of_forward_on_python_state_are_refused_by_name_and_line(model, attribute, line):
    model = model()
    x = torch.randn(16, 4, 8) if isinstance(model, StatefulLSTM) else torch.randn(16, 8)
    with pytest.raises(ModuleStateError, match=re.escape(attribute)) as error:
        torchpar.compile(model, sgd(model), example_batch=(x, torch.randn(16, 1)))
    assert f"test_training_loop.py:" in str(error.value) and line in str(error.value)


# --- .grad of a trained parameter --------------------------------------------------------------------------------


def test_a_manual_update_from_grad_is_an_error_naming_the_fix_not_a_silent_none():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = batches(1)[0]
    with torchpar.compile(model, optimizer, example_batch=batch) as engine:
        engine.step(batch)
        with pytest.raises(RuntimeError, match=r"first\.weight.*torch\.optim\.SGD\(params, lr=lr\)"):
            for p in model.parameters():  # word_language_model's update
                p.data.add_(p.grad, alpha=-0.1)
        with pytest.raises(RuntimeError, match="grad_clip_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        engine.step(batch)
        assert all(p.grad is not None for p in model.parameters())


# --- several optimizers: a GAN ------------------------------------------------------------------------------------


class Generator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.main = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8),
                                        torch.nn.Tanh())

    def forward(self, noise):
        return self.main(noise)


class Discriminator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.main = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16),
                                        torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1), torch.nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1)


def gan_data(iterations: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator))
            for _ in range(iterations)]


def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=2e-4, betas=(0.5, 0.999))  # dcgan/main.py's


def train_dcgan_in_pytorch(net_d, net_g, data) -> list[tuple[float, float]]:
    """pytorch/examples' dcgan/main.py loop: D on real then on G's fake (detached), then G through the updated D."""
    criterion = torch.nn.BCELoss()
    opt_d, opt_g = adam(net_d), adam(net_g)
    losses = []
    for real, noise in data:
        net_d.zero_grad()
        output = net_d(real)
        err_real = criterion(output, torch.ones_like(output))
        err_real.backward()
        fake = net_g(noise)
        output = net_d(fake.detach())
        err_fake = criterion(output, torch.zeros_like(output))
        err_fake.backward()
        opt_d.step()
        net_g.zero_grad()
        output = net_d(fake)
        err_g = criterion(output, torch.ones_like(output))
        err_g.backward()
        opt_g.step()
        losses.append(((err_real + err_fake).item(), err_g.item()))
    return losses


def train_dcgan_in_torchpar(net_d, net_g, data, method=None) -> list[tuple[float, float]]:
    """The same loop with two engines, one per optimizer: each step_fn calls the other network, whose latest weights
    it reads (docs/porting.md, 'Several optimizers')."""
    criterion = torch.nn.BCELoss()

    def d_step(net_d, batch):
        real, noise = batch
        fake = net_g(noise).detach()
        real_out, fake_out = net_d(real), net_d(fake)
        return criterion(real_out, torch.ones_like(real_out)) + criterion(fake_out, torch.zeros_like(fake_out))

    def g_step(net_g, noise):
        output = net_d(net_g(noise))
        return criterion(output, torch.ones_like(output))

    with (torchpar.compile(net_d, adam(net_d), example_batch=data[0], step_fn=d_step, method=method) as engine_d,
          torchpar.compile(net_g, adam(net_g), example_batch=data[0][1], step_fn=g_step, method=method) as engine_g):
        return [(engine_d.step((real, noise)).item(), engine_g.step(noise).item()) for real, noise in data]


def test_a_gan_trained_by_two_engines_alternating_is_pytorchs_gan():
    torch.manual_seed(0)
    net_d, net_g = Discriminator(), Generator()
    ref_d, ref_g = copy.deepcopy(net_d), copy.deepcopy(net_g)
    data = gan_data(5)
    expected = train_dcgan_in_pytorch(ref_d, ref_g, data)
    got = train_dcgan_in_torchpar(net_d, net_g, data)
    assert_same(torch.tensor(got), torch.tensor(expected), "(Loss_D, Loss_G) per iteration")
    assert_same_model(net_d, ref_d, "D")  # its BatchNorm statistics too: D runs 3 times per iteration in both
    assert_same_model(net_g, ref_g, "G")


def test_the_gan_on_two_ray_host_actors_is_pytorchs_gan():
    from tests.runtime.ray_helpers import ray_cluster

    torch.manual_seed(0)
    net_d, net_g = Discriminator(), Generator()
    ref_d, ref_g = copy.deepcopy(net_d), copy.deepcopy(net_g)
    data = gan_data(5)
    expected = train_dcgan_in_pytorch(ref_d, ref_g, data)
    with ray_cluster(num_hosts=2, devices_per_host=1):  # each engine: one host actor of its own
        got = train_dcgan_in_torchpar(net_d, net_g, data)
    assert_same(torch.tensor(got), torch.tensor(expected), "(Loss_D, Loss_G) per iteration")
    assert_same_model(net_d, ref_d, "D")
    assert_same_model(net_g, ref_g, "G")


def test_a_module_the_step_calls_outside_the_model_is_trained_when_the_optimizer_holds_it():
    """A learnable loss module kept beside the model (a metric-learning head, a learned temperature), its parameters
    in the same optimizer: PyTorch trains it, and so does the engine."""
    torch.manual_seed(0)
    model, head = Net(), torch.nn.Linear(1, 1)
    reference, ref_head = copy.deepcopy(model), copy.deepcopy(head)

    def step_fn(net, batch):
        x, y = batch
        return F.mse_loss(head(net.head(net.hidden(x))), y)

    def ref_step(batch):
        x, y = batch
        return F.mse_loss(ref_head(reference.head(reference.hidden(x))), y)

    ref_opt = torch.optim.SGD([*reference.parameters(), *ref_head.parameters()], lr=0.1)
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
    with torchpar.compile(model, optimizer, example_batch=batches(1)[0], step_fn=step_fn) as engine:
        assert {"outside0.weight", "outside0.bias"} <= set(engine.plan.stages[0].params)
        for step, batch in enumerate(batches(3)):
            ref_opt.zero_grad()
            loss = ref_step(batch)
            loss.backward()
            ref_opt.step()
            assert_same(engine.step(batch), loss.detach(), f"step {step}")
    assert_same_model(head, ref_head, "the outside module")
    assert_same_model(model, reference, "the model")
