"""Cost constants measured on this machine when nobody gave them (torchpar.engine.machine_constants, runtime.calibration).

The suite itself plans with the nominal constants (``TORCHPAR_COST_CONSTANTS=nominal`` in ``tests/conftest.py``), so
plans do not depend on the machine; these tests switch measuring on. Most of them replace the timed MLP steps
with a fixed machine (a test does not time anything): what is checked is how the timings become constants, reach
the plan, are cached and are left alone where a preset or hand-set constants apply. One test runs the real
measurement and checks only that it yields usable constants. How close the estimates come to measured steps is
``benchmarks/estimate_accuracy.py``'s question.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import torchpar
from torchpar.engine import machine_constants
from torchpar.cluster import ClusterSpec, current_cluster
from torchpar.runtime.measure import calibration

FAKE_FLOPS, FAKE_OP_S, FAKE_UPDATE_S = 2e10, 3e-5, 2e-9


def fake_step_seconds(devices, workload):
    """A machine of FAKE_FLOPS per device and FAKE_OP_S per op (what `_step_seconds` would time there)."""
    return 3 * workload.forward_flops / FAKE_FLOPS + workload.ops * FAKE_OP_S


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.body(x), y)


def plan_of(method, **options):
    torch.manual_seed(0)
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(32, 64), torch.randn(32, 1))
    return torchpar.plan(model, optimizer, example_batch=batch, method=method, explain=False, **options)


@pytest.fixture
def measuring(tmp_path, monkeypatch):
    """Measured constants on, a fresh profile cache, the fake machine's timings, no link timing."""
    monkeypatch.setenv(machine_constants.ENV_VAR, "measured")
    monkeypatch.setenv("TORCHPAR_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.setattr(calibration, "_step_seconds", fake_step_seconds)
    monkeypatch.setattr(calibration, "_adam_update_seconds", lambda devices, elements: elements * FAKE_UPDATE_S)
    monkeypatch.setattr(calibration, "time_links", lambda cache, devices: [])
    return tmp_path / "profiles"


def test_the_fake_machines_timings_give_back_its_rate_and_per_op_cost(measuring):
    from torchpar.runtime.measure.profile_cache import ProfileCache

    measured = calibration.measure_machine(ProfileCache(str(measuring)), __import__("jax").devices()[:4])
    assert measured.flops == pytest.approx(FAKE_FLOPS, rel=0.05)  # the op cost of one-block steps is in the rates
    assert measured.op_s == pytest.approx(FAKE_OP_S, rel=0.1)
    assert measured.update_s == pytest.approx(FAKE_UPDATE_S)
    assert measured.busy_devices == 4 and not measured.cached


def test_effective_flops_prices_the_graphs_flops_ops_and_update():
    measured = calibration.MachineConstants(flops=1e10, op_s=1e-4, update_s=1e-9, busy_devices=2, rates=(1e10,),
                                            links=(), hardware="x", cached=False)
    forward, ops, params = 2e9, 100, 1e6
    step = 3 * forward / 2 / 1e10 + ops * 1e-4 + params * 1e-9  # each device's half of the FLOPs, every op, Adam
    assert measured.effective_flops(forward, ops, params) == pytest.approx(3 * forward / 2 / step)
    sgd = 3 * forward / 2 / 1e10 + ops * 1e-4 + params * 1e-9 * 3 / 7  # no state: 3 arrays of traffic, not 7
    assert measured.effective_flops(forward, ops, params, state_copies=0) == pytest.approx(3 * forward / 2 / sgd)
    assert measured.effective_flops(1e15, 10) == pytest.approx(1e10, rel=1e-6)  # FLOPs dominate: the rate


def test_a_plan_on_nominal_constants_is_priced_with_the_measured_ones_and_says_so(measuring):
    plan = plan_of(torchpar.DataParallel())
    record = plan.solver["cost_constants"]
    assert record["source"] == "measured" and record["busy_devices"] == current_cluster().num_devices
    assert plan.cluster["device_flops"] == pytest.approx(record["device_flops"])
    assert plan.cluster["device_flops"] < FAKE_FLOPS  # the per-op cost of a small graph lowers the effective rate
    assert record["graph_params"] == sum(p.numel() for p in Mlp().parameters())
    assert current_cluster().device_flops == ClusterSpec.device_flops  # the engine's cluster is unchanged
    assert "measured on this machine" in plan.summary()


def test_one_device_is_measured_alone_and_the_second_plan_reads_the_cache(measuring, monkeypatch):
    plan = plan_of(None)
    assert plan.solver["cost_constants"]["busy_devices"] == 1
    assert not plan.solver["cost_constants"]["cached"]
    entries = list(measuring.glob("*.json"))
    assert entries and all(json.loads(e.read_text()) for e in entries)

    def no_timing(*args):
        raise AssertionError("measured again although the profile cache holds the constants")

    monkeypatch.setattr(calibration, "_step_seconds", no_timing)
    again = plan_of(None)
    assert again.solver["cost_constants"]["cached"]
    assert again.cluster["device_flops"] == plan.cluster["device_flops"]


@pytest.mark.parametrize("how", ["preset", "by hand", "nominal by choice"])
def test_a_preset_hand_set_constants_or_nominal_by_choice_are_never_measured(measuring, monkeypatch, how):
    monkeypatch.setattr(calibration, "_step_seconds", lambda *a: pytest.fail("measured"))
    cluster = current_cluster()
    if how == "preset":
        given = ClusterSpec.from_preset("a100-80g", num_hosts=cluster.num_hosts,
                                        devices_per_host=cluster.devices_per_host)
    elif how == "by hand":
        given = ClusterSpec(num_hosts=cluster.num_hosts, devices_per_host=cluster.devices_per_host, device_flops=1e11)
    else:
        monkeypatch.setenv(machine_constants.ENV_VAR, "nominal")
        given = cluster
    assert machine_constants.constants_origin(given) == {"preset": "preset", "by hand": "by hand"}.get(how, "nominal")
    priced, record = machine_constants.priced_cluster(given, torchpar.DataParallel(), graph=None)
    assert priced is given
    assert record["source"] in {"a100-80g preset", "set by hand", "nominal defaults (TORCHPAR_COST_CONSTANTS=nominal)"}


def test_an_unknown_choice_is_named(monkeypatch):
    monkeypatch.setenv(machine_constants.ENV_VAR, "guess")
    with pytest.raises(ValueError, match="TORCHPAR_COST_CONSTANTS='guess': use one of measured, nominal"):
        machine_constants.chosen_source()


def test_the_real_measurement_gives_usable_constants(tmp_path):
    from torchpar.runtime.measure.profile_cache import ProfileCache

    import jax

    measured = calibration.measure_machine(ProfileCache(str(tmp_path)), jax.devices()[:2])
    assert math.isfinite(measured.flops) and measured.flops > 1e8
    assert math.isfinite(measured.op_s) and measured.op_s >= 0
    assert len(measured.links) == 2 and all(fit.beta >= 0 and fit.alpha >= 0 for fit in measured.links)
