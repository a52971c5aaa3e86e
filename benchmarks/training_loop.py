"""What keeping the torch model and the engine one truth costs (``torchpar/engine/model_link.py``).

    python benchmarks/training_loop.py [--steps 30] [--warmup 3] [--json benchmarks/results/training_loop.json]

GPT-2 (4 layers, d=256, vocab 8192) at batch 4×256 on one CPU device, AdamW. Three engines built from the same
model, timed interleaved (one step of each per round, so machine noise hits them alike):

- ``checked``: the defaults: before each step the engine compares the model's tensors and the values ``forward``
  read with its own (identity, ``_version``, touch count), after it marks what it holds and sets ``.grad``'s stand-ins;
- ``unchecked``: the same engine with those per-step checks replaced by no-ops (what a step cost before them);
- ``ema_every_step``: ``checked`` plus ``AveragedModel.update_parameters(model)`` after every step: a pull of the
  weights into the torch model, the EMA's own arithmetic, and a push of the touched weights before the next step.

The table gives each median step and its ratio to ``unchecked``. The checks are also timed alone (the link's
``before_step`` + ``after_step``, the stand-ins, the setup comparison, 200 calls), as a fraction of the unchecked
step: the figure the ≤ 1 % bar is about. A pull (``model.state_dict()`` right after a step) and the push it causes
are timed alone as well.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from typing import Any

import torch

CONFIG = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 256}
BATCH, SEQ = 4, 256


def _without_checks(engine: Any) -> None:
    """The engine's per-step link work replaced by no-ops (the ``unchecked`` runner)."""
    engine._torch.changes = lambda: []
    engine._torch.after_step = lambda signature: None


def _checks_alone(engine: Any, signature: tuple, calls: int = 200) -> float:
    """Median seconds of one step's link work outside the executable."""
    from torchpar.engine import model_link
    seconds = []
    with model_link.suspended():
        for _ in range(calls):
            start = time.perf_counter()
            engine._torch.changes()
            engine._torch.after_step(signature)
            seconds.append(time.perf_counter() - start)
    engine._torch.link.pull()  # the loop above left the engine holding the weights: as after a step
    return statistics.median(seconds)


def measure(steps: int, warmup: int) -> dict[str, Any]:
    import torchpar
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from torchpar.engine import batches
    from torchpar.harness import zoo

    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", CONFIG, batch_size=BATCH, seq_len=SEQ)
    engines, models = {}, {}
    for name in ("checked", "unchecked", "ema_every_step"):
        models[name] = copy.deepcopy(model)
        engines[name] = torchpar.compile(models[name], torch.optim.AdamW(models[name].parameters(), lr=1e-4),
                                         example_batch=batch)
    _without_checks(engines["unchecked"])
    ema = AveragedModel(models["ema_every_step"], multi_avg_fn=get_ema_multi_avg_fn(0.999))
    times: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(warmup + steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.step(batch)
            if name == "ema_every_step":
                ema.update_parameters(models[name])
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    checked = engines["checked"]
    checks_s = _checks_alone(checked, batches.signature(batch))
    pulls, pushes = [], []
    for _ in range(5):
        checked.step(batch)
        start = time.perf_counter()
        models["checked"].state_dict()  # a pull: the engine's weights into the torch model
        pulls.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torchpar.engine.model_link.suspended():
            checked._torch.link.before_step()  # the push of what the pull handed to user code
        pushes.append(time.perf_counter() - start)
    for engine in engines.values():
        engine.close()
    unchecked = medians["unchecked"]
    return {
        "model": "gpt2", "config": CONFIG, "batch": [BATCH, SEQ], "steps": steps,
        "parameters": sum(p.numel() for p in model.parameters()),
        "median_step_s": medians,
        "ratio_to_unchecked": {name: medians[name] / unchecked for name in medians},
        "checks_alone_s": checks_s, "checks_fraction_of_step": checks_s / unchecked,
        "tracked_tensors": len(checked._compiled.tracked), "guarded_values": len(checked._torch.link.reads),
        "pull_s": statistics.median(pulls), "pull_fraction_of_step": statistics.median(pulls) / unchecked,
        "push_s": statistics.median(pushes), "push_fraction_of_step": statistics.median(pushes) / unchecked,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "training_loop.json"))
    args = parser.parse_args()
    import torchpar

    torchpar.init(cluster="local", num_devices=1)
    result = measure(args.steps, args.warmup)
    print(f"GPT-2 {CONFIG['n_layer']}x{CONFIG['n_embd']}, batch {BATCH}x{SEQ}, one CPU device, "
          f"{result['parameters']:,} parameters, {result['tracked_tensors']} tracked tensors, "
          f"{result['guarded_values']} guarded values")
    print(f"{'runner':<16}{'step ms':>10}{'× unchecked':>13}")
    for name, seconds in result["median_step_s"].items():
        print(f"{name:<16}{seconds * 1e3:>10.2f}{result['ratio_to_unchecked'][name]:>13.3f}")
    print(f"checks alone: {result['checks_alone_s'] * 1e6:.0f} µs per step = "
          f"{result['checks_fraction_of_step'] * 100:.2f} % of the unchecked step")
    print(f"a pull (state_dict after a step): {result['pull_s'] * 1e3:.2f} ms = "
          f"{result['pull_fraction_of_step'] * 100:.1f} % of a step; the push it causes: "
          f"{result['push_s'] * 1e3:.2f} ms = {result['push_fraction_of_step'] * 100:.1f} %")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
