"""What the Ray runtime costs next to the local one: the same model and method, side by side.

    python benchmarks/ray_runtime.py [--model gpt2] [--config '{"n_layer": 2}'] [--batch-size 8] [--seq-len 64]
                                     [--hosts 1] [--devices-per-host 1] [--method none|dp] [--steps 10]

Builds two engines in this process: the local runtime on ``hosts × devices_per_host`` devices of this
process, and the Ray runtime on ``hosts`` host actors of ``devices_per_host`` devices each (GPUs when the
machine has enough, else JAX CPU devices). Their steps alternate (one of each per round); the medians and
their ratio are reported, with where each actor's state lives (platform and devices, from the actors).
On a GPU machine ``--hosts 1 --devices-per-host 1`` is the "one host × one GPU" run. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--config", default='{"n_layer": 2}')
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--devices-per-host", type=int, default=1)
    parser.add_argument("--method", choices=("none", "dp"), default="none")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default="benchmarks/results/ray_runtime.json")
    args = parser.parse_args(argv)
    devices = args.hosts * args.devices_per_host

    import torchpar

    torchpar.init(cluster="local", num_devices=devices)
    import torch

    from torchpar.harness import zoo

    def build():
        torch.manual_seed(0)
        model, batch = zoo.build(args.model, json.loads(args.config), batch_size=args.batch_size,
                                 seq_len=args.seq_len)
        method = torchpar.DataParallel() if args.method == "dp" else None
        engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-4), example_batch=batch,
                                  method=method)
        return engine, batch

    start = time.perf_counter()
    local, batch = build()
    local_compile = time.perf_counter() - start
    torchpar.init(cluster="ray", num_hosts=args.hosts, devices_per_host=args.devices_per_host)
    start = time.perf_counter()
    remote, _ = build()
    remote_compile = time.perf_counter() - start
    times: dict[str, list[float]] = {"local": [], "ray": []}
    losses: dict[str, list[float]] = {"local": [], "ray": []}
    for round_index in range(args.warmup + args.steps):
        for name, engine in (("local", local), ("ray", remote)):
            begin = time.perf_counter()
            loss = engine.step(batch).item()
            elapsed = time.perf_counter() - begin
            if round_index >= args.warmup:
                times[name].append(elapsed)
                losses[name].append(loss)
    workers = remote.describe_workers()
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["ray"] / medians["local"]
    print(f"{args.model} {args.config}, batch {args.batch_size}×{args.seq_len}, method {args.method}, "
          f"{args.hosts} host(s) × {args.devices_per_host} device(s)")
    print(f"{'runtime':<8}{'compile s':>11}{'median step ms':>16}")
    print(f"{'local':<8}{local_compile:>11.2f}{medians['local'] * 1e3:>16.2f}")
    print(f"{'ray':<8}{remote_compile:>11.2f}{medians['ray'] * 1e3:>16.2f}")
    print(f"ray / local step time: {ratio:.3f}; losses agree: "
          f"{max(abs(a - b) for a, b in zip(losses['local'], losses['ray'])):.2e} max difference")
    for w in workers:
        print(f"host actor {w['rank']}: pid {w['pid']}, platform {w['platform']}, state on {w['devices_holding_state']}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"config": vars(args), "median_step_s": medians, "all_step_s": times, "ray_over_local": ratio,
                   "compile_s": {"local": local_compile, "ray": remote_compile}, "workers": workers,
                   "timings_ray": remote.plan.timings}, handle, indent=1, default=str)
    print(f"wrote {args.json}")
    local.close()
    remote.close()
    torchpar.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
