"""Estimated against measured step time on fake CPU devices: nominal cost constants and this machine's measured ones.

    python benchmarks/estimate_accuracy.py [--devices 4] [--steps 8] [--json benchmarks/results/estimate_accuracy.json]

For each model (the README's GPT-2, a wider GPT-2, two MLPs) and each method (one device, DataParallel on
``--devices`` fake CPU devices) the same model is planned twice — with the nominal constants
(``TORCHPAR_COST_CONSTANTS=nominal``) and with the constants measured on this machine (the default,
:mod:`torchpar.engine.machine_constants`) — and trained for ``--steps`` steps; the table gives both estimates, the
measured step (median of the steps after the first three: compilation and warm-up excluded) and each ratio
measured / estimated. The measurement is cached in the profile cache: delete ``~/.cache/torchpar/profiles`` (or
set ``TORCHPAR_PROFILE_DIR``) to measure again, e.g. after the machine's load changed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from typing import Any, Callable

import torch


def _gpt2(width: int, batch: int, seq: int) -> Callable[[], tuple[torch.nn.Module, Any]]:
    def make():
        import transformers

        config = transformers.GPT2Config(n_layer=2, n_embd=width, n_head=4, vocab_size=1024, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0)
        ids = torch.randint(0, 1024, (batch, seq))
        return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}
    return make


class _Mlp(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.body = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.body(x), y)


def _mlp(width: int, rows: int) -> Callable[[], tuple[torch.nn.Module, Any]]:
    return lambda: (_Mlp(width, 4), (torch.randn(rows, width), torch.randn(rows, 1)))


MODELS = {"gpt2 128 (README)": _gpt2(128, 8, 64), "gpt2 256": _gpt2(256, 16, 128),
          "mlp 512": _mlp(512, 256), "mlp 1024": _mlp(1024, 512)}


def _estimate(make, method: Any, source: str) -> float:
    import torchpar

    os.environ["TORCHPAR_COST_CONSTANTS"] = source
    torch.manual_seed(0)
    model, batch = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return torchpar.plan(model, optimizer, example_batch=batch, method=method, explain=False).estimated_step_s


def _measured(make, method: Any, steps: int) -> float:
    import torchpar

    torch.manual_seed(0)
    model, batch = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torchpar.compile(model, optimizer, example_batch=batch, method=method) as engine:
        times = []
        for _ in range(steps):
            engine.step(batch)
            times.append(engine.last_metrics.step_time_s)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torchpar

    torchpar.init(cluster="local", num_devices=args.devices, compile_cache=False)
    from tqdm.auto import tqdm

    rows = []
    cases = [(name, kind) for name in MODELS for kind in ("one device", "DataParallel")]
    for name, kind in tqdm(cases, desc="estimate accuracy", unit="case", file=sys.stderr):
        method = None if kind == "one device" else torchpar.DataParallel()
        nominal = _estimate(MODELS[name], method, "nominal")
        measured_constants = _estimate(MODELS[name], method, "measured")
        step = _measured(MODELS[name], method, args.steps)
        rows.append({"model": name, "method": kind, "measured_step_s": step, "estimate_nominal_s": nominal,
                     "estimate_measured_constants_s": measured_constants, "ratio_nominal": step / nominal,
                     "ratio_measured_constants": step / measured_constants})
    print(f"{'model':<18} {'method':<13} {'measured':>10} {'est nominal':>12} {'ratio':>7} {'est measured':>13} "
          f"{'ratio':>7}")
    for row in rows:
        print(f"{row['model']:<18} {row['method']:<13} {row['measured_step_s'] * 1e3:8.1f}ms "
              f"{row['estimate_nominal_s'] * 1e3:10.1f}ms {row['ratio_nominal']:7.2f} "
              f"{row['estimate_measured_constants_s'] * 1e3:11.1f}ms {row['ratio_measured_constants']:7.2f}")
    worst = max(max(r["ratio_measured_constants"], 1 / r["ratio_measured_constants"]) for r in rows)
    print(f"worst factor between estimate and measurement with measured constants: {worst:.2f}×")
    result = {"machine": {"processor": platform.processor(), "cores": os.cpu_count(), "devices": args.devices},
              "rows": rows, "worst_factor_measured_constants": worst}
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
