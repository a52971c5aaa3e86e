"""Shared set-up of the Ray runtime tests: a simulated cluster, training against PyTorch, worker accounts."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable, Iterator

import torch
import transformers

import torchpar
from torchpar.report.hlo import collectives

LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6


@contextlib.contextmanager
def local_cluster(**init_kwargs: Any) -> Iterator[torchpar.ClusterSpec]:
    """``torchpar.init(cluster="local", ...)`` for the block (e.g. 2 hosts × 1 device: a 2-stage pipeline, one device
    per stage), then the local cluster shape in force before it."""
    from torchpar.cluster import current_cluster

    before = current_cluster()
    torchpar.shutdown()
    try:
        yield torchpar.init(cluster="local", **init_kwargs)
    finally:
        torchpar.shutdown()
        torchpar.init(cluster="local", num_hosts=before.num_hosts, devices_per_host=before.devices_per_host)


@contextlib.contextmanager
def ray_cluster(*, fresh: bool = False, **init_kwargs: Any) -> Iterator[torchpar.ClusterSpec]:
    """``torchpar.init(cluster="ray", ...)`` for the block; afterwards every engine is closed (its host actors
    gone, their CPUs free) and the test session's local 8-device cluster is back.

    Starting and stopping the embedded Ray instance costs ~5 s of the 2-core CI machine per block, and what a
    block starts on it (host actors) is all gone when the block ends, so the instance ``torchpar.init`` started
    is kept for the next block when it has a CPU for every host actor; otherwise it is stopped and a new one
    started. ``fresh=True``: a new instance for the block, stopped after it (a test that counts the instance's
    CPUs). Any ``torchpar.shutdown()`` stops the kept one, and so does the end of the session
    (``tests/conftest.py``)."""
    import ray

    from torchpar.runtime.executor import close_all

    hosts = init_kwargs.get("num_hosts") or 1
    keep = (not fresh and init_kwargs.get("address") is None and ray.is_initialized()
            and ray.cluster_resources().get("CPU", 0) >= hosts)
    if keep:
        close_all()
    else:
        torchpar.shutdown()
    try:
        yield torchpar.init(cluster="ray", **init_kwargs)
    finally:
        if fresh:
            torchpar.shutdown()
        else:
            close_all()
        torchpar.init(cluster="local", num_devices=8)


def qwen2(num_layers: int = 4) -> tuple[torch.nn.Module, dict]:
    config = transformers.Qwen2Config(num_hidden_layers=num_layers, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64)
    ids = torch.randint(0, 128, (8, 16))
    return transformers.Qwen2ForCausalLM(config), {"input_ids": ids, "labels": ids}


def gpt2(num_layers: int = 4) -> tuple[torch.nn.Module, dict]:
    config = transformers.GPT2Config(n_layer=num_layers, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 128, (8, 16))
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(*batch) if isinstance(batch, tuple) else model(**batch).loss


def train_against_pytorch(model: torch.nn.Module, batch: Any, method: Any, steps: int,
                          make_opt: Callable = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                          **compile_kwargs: Any) -> Any:
    """Train a copy with PyTorch and ``model`` with torchpar side by side; assert every loss and, at the end,
    every parameter (SGD: element-wise) agree. Returns the open engine (the caller closes it)."""
    reference = copy.deepcopy(model)
    ref_opt = make_opt(reference)
    engine = torchpar.compile(model, make_opt(model), example_batch=batch, method=method, **compile_kwargs)
    try:
        for step in range(steps):
            ref_opt.zero_grad()
            loss = _loss(reference, batch)
            loss.backward()
            if compile_kwargs.get("grad_clip_norm"):
                torch.nn.utils.clip_grad_norm_(reference.parameters(), compile_kwargs["grad_clip_norm"])
            ref_opt.step()
            ours = engine.step(batch)
            assert abs(ours - loss.item()) <= LOSS_RTOL * abs(loss.item()), f"step {step}: {ours} vs {loss.item()}"
        engine.sync_to_torch()
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(q, p, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m, name=name: f"{name}: {m}")
    except BaseException:
        engine.close()
        raise
    return engine


def crossing_collectives(worker: dict[str, Any], stage: int = 0) -> list[Any]:
    """Collectives of the program ``worker`` runs for ``stage`` whose device groups include devices of several
    processes (from the worker's own HLO and device assignment)."""
    program = worker["programs"][stage]
    processes = program["device_processes"]
    found = []
    for collective in collectives(program["hlo"]):
        groups = collective.groups or [list(range(len(processes)))]
        if any(len({processes[i] for i in group}) > 1 for group in groups):
            found.append(collective)
    return found


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()
