"""What the safety checks cost: index-range checks of the batch and the non-finite step guard.

    python benchmarks/safety_checks.py [--steps 30] [--warmup 3] [--json benchmarks/results/safety_checks.json]

GPT-2 (4 layers, d=256, vocab 8192) at batch 4×256 on one CPU device, AdamW, three engines built from the same
model, timed interleaved (one step of each per round, so machine noise hits them alike):

- ``checked``: the defaults, ``check_inputs=True, on_nonfinite="raise"`` (input ranges checked on the host; the
  step skips its own update unless the loss and gradients are finite);
- ``no_input_check``: ``check_inputs=False`` (the guard stays);
- ``unchecked``: ``check_inputs=False, on_nonfinite="ignore"`` (neither).

The table gives each median step time and its ratio to ``unchecked``; the input check's own cost is also timed
alone (``check_index_inputs`` on the batch), as a fraction of the unchecked step.
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

RUNNERS = {
    "checked": {},
    "no_input_check": {"check_inputs": False},
    "unchecked": {"check_inputs": False, "on_nonfinite": "ignore"},
}


def measure(steps: int, warmup: int) -> dict[str, Any]:
    import torchpar
    from torchpar.harness import zoo
    from torchpar.ir.index_inputs import check_index_inputs, index_bounds

    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", CONFIG, batch_size=BATCH, seq_len=SEQ)
    engines = {}
    for name, options in RUNNERS.items():
        copy_of_model = copy.deepcopy(model)
        engines[name] = torchpar.compile(copy_of_model, torch.optim.AdamW(copy_of_model.parameters(), lr=1e-4),
                                         example_batch=batch, **options)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(warmup + steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.step(batch)
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    bounds = index_bounds(engines["checked"].graph)
    leaves = [leaf.numpy() for leaf in batch.values()]
    names = [f"batch['{key}']" for key in batch]
    check_s = []
    for _ in range(200):
        start = time.perf_counter()
        check_index_inputs(bounds, leaves, names)
        check_s.append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for engine in engines.values():
        engine.close()
    return {
        "model": "gpt2", "config": CONFIG, "batch": [BATCH, SEQ], "steps": steps,
        "median_step_s": medians,
        "ratio_to_unchecked": {name: medians[name] / medians["unchecked"] for name in medians},
        "input_check_s": statistics.median(check_s),
        "input_check_fraction_of_step": statistics.median(check_s) / medians["unchecked"],
        "checked_inputs": len(bounds),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/safety_checks.json")
    args = parser.parse_args()
    import torchpar

    torchpar.init(cluster="local", num_devices=1)
    result = measure(args.steps, args.warmup)
    print(f"GPT-2 {CONFIG['n_layer']}×{CONFIG['n_embd']}, batch {BATCH}×{SEQ}, one CPU device, "
          f"median of {args.steps} interleaved steps")
    print(f"{'runner':<16} {'step (ms)':>10} {'× unchecked':>12}")
    for name, seconds in result["median_step_s"].items():
        print(f"{name:<16} {seconds * 1e3:>10.2f} {result['ratio_to_unchecked'][name]:>12.3f}")
    print(f"input check alone: {result['input_check_s'] * 1e6:.1f} µs for {result['checked_inputs']} checked "
          f"input(s) = {result['input_check_fraction_of_step'] * 100:.3f}% of the unchecked step")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
