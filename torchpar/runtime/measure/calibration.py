"""This machine's cost constants, measured: how fast one device trains while ``k`` devices run at once.

The planner prices a step as ``3·F / device_flops`` plus alpha-beta collectives
(:mod:`torchpar.planner.pipeline.stage_cost`). A hardware preset gives those constants for real GPUs; on any other
machine — fake JAX CPU devices above all, which share the host's cores — the nominal defaults are off by 5–35×. This
module measures, with ``k`` devices busy (each runs its own copy of the same jitted program on its own data: one program
split over a ``k``-device mesh, nothing exchanged; fake devices divide the host's cores, so one device alone runs faster
than each of four):

- ``flops``: MLP training steps (``x·W1 → GELU → ·W2``, mean squared error, forward, backward, an SGD update) of
  widths 128 to 512 are timed; each gives ``3·F / t`` with ``F`` the forward matmul FLOPs (the estimate's own
  convention: backward, elementwise work and update fold into the rate), and ``flops`` is their geometric mean;
- ``op_s``: a step of 6 narrow transformer blocks (layer norms, attention, GELU MLP, a language-model head and
  cross-entropy: 64 ops as the IR counts a PyTorch module's, few FLOPs) is timed; what its FLOPs do not explain,
  divided by its ops, is the time each forward op of the IR adds to a step (kernel launches, small tensors, the
  norms', softmaxes' and gathers' passes over memory);
- ``update_s``: an Adam update (the moments and the parameter: 7 arrays read or written per element) of 4 Mi
  float32 parameters is timed; per parameter element it is the update's cost, scaled for another optimizer by its
  memory traffic, ``3 + 2·c`` arrays for ``c`` state copies (SGD without momentum: 3);
- the in-host links: all-reduces timed over the ``k`` devices and fitted per mesh axis
  (:func:`torchpar.runtime.measure.profiler.time_links`, ``profile=True``'s measurement).

A graph of ``F`` forward FLOPs, ``n`` ops and ``P`` trainable parameter elements is then priced at the effective
rate ``(3F/k) / (3F/(k·flops) + n·op_s + P·update_s)`` (:meth:`MachineConstants.effective_flops`): one
``device_flops`` per plan, so the cost model keeps its single compute constant. The update is priced whole on every
device, as one device and data parallelism run it; a plan that shards the optimizer state (ZeRO, tensor
parallelism) updates less per device, and is estimated a little slow. Results are kept in the profile cache
(:mod:`.profile_cache`) by hardware, ``k``, jax version and :data:`WORKLOAD_VERSION`: a machine is measured once (a few
seconds), later plans read the file.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict, cast

import jax
import jax.numpy as jnp
import numpy as np

from torchpar.planner.profiling import LinkFit
from torchpar.runtime.measure.profile_cache import ProfileCache, hardware_name
from torchpar.runtime.measure.profiler import time_links

log = logging.getLogger(__name__)

WORKLOAD_VERSION = 5
"""Bumped when the timed workloads change; older cache entries are then never read."""
REPEATS = 5
"""Timed runs of each step after the compiling one; the median is kept."""


@dataclass(frozen=True)
class Workload:
    """A training step to time, per device: ``blocks`` MLP blocks (``x·W1 → GELU → ·W2``, mean squared error) or
    transformer blocks (layer norm, QKV, softmax attention, output projection, residual, layer norm, GELU MLP,
    residual; a language-model head and cross-entropy) on ``batch × seq`` rows of ``width``."""

    kind: str
    batch: int
    seq: int
    width: int
    hidden: int
    blocks: int
    heads: int = 1
    vocab: int = 0

    @property
    def forward_flops(self) -> float:
        """Forward FLOPs as the IR counts them (:func:`torchpar.ir.costs.op_flops`: matmuls, attention's two products;
        the elementwise work is left out here, it is small)."""
        rows, d = self.batch * self.seq, self.width
        if self.kind == "mlp":
            return 2.0 * rows * d * self.hidden * 2 * self.blocks
        per_block = 2.0 * rows * d * (3 * d + d + 2 * self.hidden) + 4.0 * self.batch * self.seq * self.seq * d
        return per_block * self.blocks + 2.0 * rows * d * self.vocab

    @property
    def ops(self) -> int:
        """Forward ops as the IR has them for the PyTorch module of this step (views free): an MLP block is
        matmul, GELU, matmul (+ sub, pow, mean); a transformer block is 2 layer norms, 4 linear layers, attention,
        GELU and 2 residual adds (+ the final norm, head and log-softmax / NLL loss)."""
        return 3 * self.blocks + 3 if self.kind == "mlp" else 10 * self.blocks + 4


RATE_WORKLOADS = (
    Workload("mlp", 1, 512, 128, 512, 1),
    Workload("mlp", 1, 256, 256, 1024, 1),
    Workload("mlp", 1, 512, 384, 1536, 1),
    Workload("mlp", 1, 512, 512, 2048, 1),
)
"""The MLP steps the FLOP rate is the geometric mean of: widths from 128 to 512, where the models trained on fake
devices sit (narrow matmuls run below the rate of wide ones)."""
UPDATE_ELEMENTS = 1 << 22
"""Parameter elements of the timed Adam update (16 MiB of float32: past the caches, as a model's parameters are)."""
ADAM_TRAFFIC = 7.0
"""Arrays an Adam update reads or writes per element: parameter, gradient, two moments read; three written."""
OVERHEAD_WORKLOAD = Workload("transformer", 4, 64, 32, 128, 6, heads=2, vocab=256)
"""The step whose time is mostly per-op cost: 6 narrow transformer blocks, 64 ops and few FLOPs."""


class MachineEntry(TypedDict):
    """What the profile cache keeps of a machine's measurement (its links are kept apart, by :func:`time_links`)."""

    rates: list[float]
    flops: float
    op_s: float
    update_s: float


@dataclass(frozen=True)
class MachineConstants:
    """What this machine measured with ``busy_devices`` devices running at once: ``flops`` (training FLOP/s of one
    device on matmul-sized work, the geometric mean of ``rates``), ``op_s`` (seconds each forward op of the IR adds
    to a step, forward and backward together), ``update_s`` (seconds of an Adam update per parameter element), the
    in-host link fits (empty for one device)."""

    flops: float
    op_s: float
    update_s: float
    busy_devices: int
    rates: tuple[float, ...]
    links: tuple[LinkFit, ...]
    hardware: str
    cached: bool

    def effective_flops(self, forward_flops: float, ops: int, params: float = 0.0, state_copies: float = 2.0) -> float:
        """The FLOP/s one device runs a step of ``forward_flops``, ``ops`` forward ops and ``params`` trainable
        elements updated by an optimizer of ``state_copies`` state tensors per parameter at, the FLOPs split over the
        busy devices: ``3F/k / (3F/(k·flops) + ops·op_s + P·update_s·(3 + 2c)/7)`` — the constant the planner prices
        every FLOP with."""
        work = 3.0 * max(forward_flops, 1.0) / self.busy_devices
        update = params * self.update_s * (3.0 + 2.0 * state_copies) / ADAM_TRAFFIC
        return work / (work / self.flops + ops * self.op_s + update)

    def to_dict(self) -> dict[str, object]:
        return {
            "source": "measured",
            "flops": self.flops,
            "op_s": self.op_s,
            "update_s": self.update_s,
            "busy_devices": self.busy_devices,
            "rates": list(self.rates),
            "links": [fit.to_dict() for fit in self.links],
            "hardware": self.hardware,
            "cached": self.cached,
        }


def measure_machine(cache: ProfileCache, devices: Sequence[jax.Device]) -> MachineConstants:
    """The constants of ``devices`` all busy at once (module docstring), from ``cache`` when it has them."""
    hardware = hardware_name(devices)
    key = {
        "kind": "training_flops",
        "busy_devices": len(devices),
        "hardware": hardware,
        "jax": jax.__version__,
        "workload": WORKLOAD_VERSION,
        "repeats": REPEATS,
    }
    stored = cast("MachineEntry | None", cache.get(key))  # what this function put under a training_flops key
    cached = stored is not None
    if stored is None:
        rates = [3.0 * w.forward_flops / _step_seconds(devices, w) for w in RATE_WORKLOADS]
        flops = float(statistics.geometric_mean(rates))
        overhead = OVERHEAD_WORKLOAD
        spent = _step_seconds(devices, overhead) - 3.0 * overhead.forward_flops / flops
        stored = {
            "rates": rates,
            "flops": flops,
            "op_s": max(spent, 0.0) / overhead.ops,
            "update_s": _adam_update_seconds(devices, UPDATE_ELEMENTS) / UPDATE_ELEMENTS,
        }
        cache.put(key, stored)
    links = tuple(time_links(cache, devices))
    log.info(
        "torchpar: measured cost constants (%d busy device(s) of %s%s): %.3g FLOP/s per device, %.3g s per op",
        len(devices),
        hardware,
        ", from the profile cache" if cached else "",
        stored["flops"],
        stored["op_s"],
    )
    return MachineConstants(
        flops=float(stored["flops"]),
        op_s=float(stored["op_s"]),
        update_s=float(stored["update_s"]),
        busy_devices=len(devices),
        rates=tuple(float(r) for r in stored["rates"]),
        links=links,
        hardware=hardware,
        cached=cached,
    )


def _layer_norm(x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-5)


def _transformer_loss(workload: Workload, weights: list, x: jax.Array, labels: jax.Array) -> jax.Array:
    b, t, d, h = workload.batch, workload.seq, workload.width, workload.heads
    for qkv, out, up, down in weights[:-1]:
        q, k, v = jnp.split(_layer_norm(x) @ qkv, 3, axis=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for z in (q, k, v))
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(d // h)
        causal = jnp.tril(jnp.ones((t, t), bool))
        attended = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1), v)
        x = x + attended.transpose(0, 2, 1, 3).reshape(b, t, d) @ out
        x = x + jax.nn.gelu(_layer_norm(x) @ up) @ down
    logits = _layer_norm(x) @ weights[-1]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)
    return -jnp.mean(picked)


def _mlp_loss(workload: Workload, weights: list, x: jax.Array, y: jax.Array) -> jax.Array:
    for first, second in weights:
        x = jax.nn.gelu(x @ first) @ second
    return jnp.mean((x - y) ** 2)


def _step_seconds(devices: Sequence[jax.Device], workload: Workload) -> float:
    """Median seconds of one training step of ``workload`` (forward, backward, an SGD update), every device of
    ``devices`` running its own copy at once."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    count, w = len(devices), workload
    mesh = Mesh(np.array(devices), ("busy",))
    split = NamedSharding(mesh, PartitionSpec("busy"))
    loss_of = _mlp_loss if w.kind == "mlp" else _transformer_loss

    def step(weights: list, x: jax.Array, y: jax.Array) -> list:
        grads = jax.grad(lambda ws: loss_of(w, ws, x, y))(weights)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, weights, grads)

    every_device = jax.jit(jax.vmap(step), in_shardings=split, out_shardings=split)
    rng = np.random.default_rng(0)

    def draw(*shape: int) -> jax.Array:
        return jax.device_put(rng.standard_normal((count, *shape), dtype=np.float32) * 0.05, split)

    d = w.width
    if w.kind == "mlp":
        weights: list = [(draw(d, w.hidden), draw(w.hidden, d)) for _ in range(w.blocks)]
        x, y = draw(w.batch * w.seq, d), draw(w.batch * w.seq, d)
    else:
        weights = [(draw(d, 3 * d), draw(d, d), draw(d, w.hidden), draw(w.hidden, d)) for _ in range(w.blocks)]
        weights.append(draw(d, w.vocab))
        x = draw(w.batch, w.seq, d)
        y = jax.device_put(rng.integers(0, w.vocab, (count, w.batch, w.seq), dtype=np.int32), split)
    return _median_seconds(lambda: every_device(weights, x, y))


def _adam_update_seconds(devices: Sequence[jax.Device], elements: int) -> float:
    """Median seconds of an Adam update of ``elements`` float32 parameters, on every device of ``devices`` at once."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    split = NamedSharding(Mesh(np.array(devices), ("busy",)), PartitionSpec("busy"))

    def update(p: jax.Array, g: jax.Array, m: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        return p - 1e-3 * (m / (jnp.sqrt(v) + 1e-8) + 0.01 * p), m, v

    every_device = jax.jit(update, in_shardings=split, out_shardings=split, donate_argnums=(0, 2, 3))
    p, g, m, v = (jax.device_put(np.full((len(devices) * elements,), 0.5, np.float32), split) for _ in range(4))
    state = [p, m, v]  # donated each call: the next call takes the outputs

    def step() -> list[jax.Array]:
        state[:] = every_device(state[0], g, state[1], state[2])
        return state

    return _median_seconds(step)


def _median_seconds(run: Callable[[], object]) -> float:
    """Median wall seconds of ``run()`` until its outputs are ready, over :data:`REPEATS` calls after a first
    (compiling) one."""
    jax.block_until_ready(run())
    times = []
    for _ in range(REPEATS):
        begin = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - begin)
    return statistics.median(times)
