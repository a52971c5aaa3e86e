"""The Ray part of the fault table: engines free what they start and fail fast — close / ``with`` /
``torchpar.shutdown``, failed compiles, a killed host process, a hung one (stopped, past the timeout), too few
CPUs for the actors, GPUs the cluster lacks. (Actors a cluster cannot place: ``tests/runtime/test_ray_cluster.py``.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch

import torchpar
from tests.runtime.ray_helpers import ray_cluster, wait_until
from torchpar.runtime.executor import open_executors


CYCLES = 4
"""Compile/close cycles of the leak test: two closed by ``close()``, two by ``with``, alternating; each cycle
asserts that every CPU is free again, so a leak shows at the first cycle of its kind, and the second of each
kind checks that a freed actor's CPU is reusable (more cycles repeat exactly these paths, ~6 s each)."""


def _mlp_batch(width: int = 16, rows: int = 8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    return model, (torch.randn(rows, width),)


def _loss_fn(outputs, batch):
    return (outputs ** 2).mean()


def _compile(model, batch, **kwargs):
    return torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch[0],
                            loss_fn=_loss_fn, **kwargs)


def _all_cpus_free() -> bool:
    return ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", 0)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _dead(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_repeated_compile_close_cycles_leave_no_actor_and_no_cpu_reserved():
    with ray_cluster(num_hosts=1, devices_per_host=1):
        model, batch = _mlp_batch()
        actors = []
        for cycle in range(CYCLES):
            if cycle % 2:
                with _compile(model, batch) as engine:  # the context manager closes the engine
                    engine.step(batch[0])
                    actors += engine.executor.actors
            else:
                engine = _compile(model, batch)
                engine.step(batch[0])
                actors += engine.executor.actors
                engine.close()
            assert engine.closed
            assert _all_cpus_free(), f"cycle {cycle}: {ray.available_resources()} of {ray.cluster_resources()}"
        assert len(actors) == CYCLES and all(_dead(a) for a in actors)
        assert not open_executors()


def test_a_failed_compile_frees_its_actors():
    with ray_cluster(num_hosts=2, devices_per_host=2):
        model, batch = _mlp_batch()
        plan = torchpar.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch[0],
                             loss_fn=_loss_fn, method=torchpar.DataParallel())
        plan.stages[0].params["2.weight"] = [[1], None]  # a [1, 16] weight cannot be split 4 ways along dim 0
        with pytest.raises(ValueError, match=r"host \d \(node .*\) running stage\(s\) \[0\] failed while loading"):
            _compile(model, batch, method=plan)  # the actors start, then fail placing the state
        assert not open_executors()
        assert wait_until(_all_cpus_free), ray.available_resources()


def test_an_engine_holding_the_cpus_is_named_and_shutdown_frees_every_engine():
    # a new embedded Ray with as many CPUs as the machine's cores (2 on CI): one engine takes both
    with ray_cluster(num_hosts=2, devices_per_host=1, fresh=True):
        model, batch = _mlp_batch()
        holder = _compile(model, batch, method=torchpar.DataParallel())
        with pytest.raises(RuntimeError, match=r"(?s)0 free CPU\(s\).*1 open torchpar engine.*data_parallel.*close\(\)"):
            _compile(model, batch, method=torchpar.DataParallel())
        assert not holder.closed and holder.step(batch[0]) > 0  # the failed compile did not disturb it
        pids = [w["pid"] for w in holder.describe_workers()]
        torchpar.shutdown()
        assert holder.closed and not open_executors()
        assert wait_until(lambda: not any(_process_alive(pid) for pid in pids)), "host actor processes outlived shutdown"


def test_killing_one_process_of_a_spanning_mesh_raises_within_the_timeout():
    with ray_cluster(num_hosts=2, devices_per_host=2, timeout_s=30):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        batch = (torch.randn(512, 256),)
        engine = _compile(model, batch, method=torchpar.DataParallel())
        try:
            engine.step(batch[0])
            victim = engine.describe_workers()[1]
            assert victim["process_count"] == 2
            killer = threading.Timer(0.2, lambda: os.kill(victim["pid"], signal.SIGKILL))
            start = time.monotonic()
            killer.start()
            with pytest.raises(RuntimeError, match=r"host 1 \(node .*, pid \d+\) running stage\(s\) \[0\]"):
                for _ in range(200):  # the kill lands inside one of these steps (or between two)
                    engine.step(batch[0])
            assert time.monotonic() - start < 60
            with pytest.raises(RuntimeError, match="closed"):
                engine.step(batch[0])
        finally:
            engine.close()
        assert wait_until(_all_cpus_free)


def test_a_hung_host_process_fails_the_step_past_the_timeout_naming_it():
    with ray_cluster(num_hosts=2, devices_per_host=1, timeout_s=8):
        model, batch = _mlp_batch()
        engine = _compile(model, batch, method=torchpar.DataParallel())
        stopped = None
        try:
            engine.step(batch[0])
            stopped = engine.describe_workers()[1]["pid"]
            os.kill(stopped, signal.SIGSTOP)  # alive but never answers: its peer waits in the all-reduce
            start = time.monotonic()
            hung = r"(?s)timed out after 8s.*did not finish; host 1 \(node [^)]*\) running stage\(s\) \[0\] does not answer"
            with pytest.raises(RuntimeError, match=hung):
                engine.step(batch[0])
            assert time.monotonic() - start < 30
            assert engine.closed
        finally:
            if stopped is not None and _process_alive(stopped):
                os.kill(stopped, signal.SIGCONT)
            engine.close()
        assert wait_until(_all_cpus_free)


def test_asking_for_gpus_the_cluster_lacks_is_an_error():
    torchpar.shutdown()
    try:
        with pytest.raises(ValueError, match="accelerator='gpu' needs 2 × 1 = 2 GPUs"):
            torchpar.init(cluster="ray", num_hosts=2, devices_per_host=1, accelerator="gpu")
    finally:
        torchpar.shutdown()
        torchpar.init(cluster="local", num_devices=8)
