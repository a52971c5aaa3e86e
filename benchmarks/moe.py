"""Mixture-of-experts step time on one device: torchpar against PyTorch eager, as the number of experts grows; and
on several (fake CPU) devices, the experts replicated, tensor-split and expert-split side by side.

    python benchmarks/moe.py [--experts 8,32,64] [--top-k 2] [--steps 5] [--warmup 2] [--json out.json]
    python benchmarks/moe.py --runners "torchpar,torchpar gathered,torchpar ragged_dot" --json benchmarks/results/moe_lowerings.json
    python benchmarks/moe.py --experts 8 --top-k 1,2,4 --runners torchpar --json benchmarks/results/moe_top_k.json
    python benchmarks/moe.py --devices 4 [--experts 8,32] [--json benchmarks/results/moe_sharded.json]

HF ``MixtralForCausalLM`` (2 layers, hidden 256, expert hidden 512, 4 heads, vocabulary 1,024; its default
``grouped_mm`` experts path), batch 8 × 256, AdamW, fp32. Runners train the same model, timed interleaved (one
step of each per round, medians): PyTorch eager; torchpar with ``_grouped_mm`` lowered in blocks of one
expert's rows (``jaxbackend/ops/grouped_matmul.py``) in the backend's default method (on the CPU a loop over the
blocks), and in the ``"gathered"`` method (one batched matmul of every block, its weights gathered: the default on a
GPU); torchpar with ``jax.lax.ragged_dot`` as XLA expands it (every expert computed on every row). ``--runners``
picks the torchpar ones; by default only the first runs beside eager (the others' steps are slower and larger and
slow down whichever step follows them). The work of an exact grouped matmul grows with the rows (tokens × top-k), not with the number of
experts: the table shows how each runner's step grows from the first row (``--top-k 1,2,4``: with top-k).

With ``--devices D`` the same model trains under ``ShardParallel(mesh_shape=(1, D), experts=...)`` for each way a
grouped matmul can be laid out — ``replicated`` (every expert on every device), ``tensor`` (each expert's hidden
dims split), ``split`` (experts split over the devices, tokens exchanged by all-to-all) — and ``auto`` (the ILP's
choice), timed interleaved; each row gives the step time, XLA's memory per device (arguments + temporaries of the
compiled step) and the plan's estimates of both beside it. Fake CPU devices share this machine's cores: the times
compare the layouts with each other, not with real devices.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch
from single_device import _torch_step as eager_torch_step  # benchmarks/ is on sys.path when a script runs

CONFIG = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256)
BATCH, SEQ = 8, 256


RUNNERS = ("eager", "torchpar", "torchpar gathered", "torchpar ragged_dot")


def measure(experts: int, top_k: int, steps: int, warmup: int, runners_kept: tuple[str, ...] = RUNNERS
            ) -> dict[str, Any]:
    import transformers

    import torchpar
    from jaxbackend.ops import grouped_matmul, linalg

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **CONFIG, num_local_experts=experts, num_experts_per_tok=top_k))
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    batch = {"input_ids": ids, "labels": ids}
    eager = copy.deepcopy(model)
    runners: dict[str, Callable[[], float]] = {
        "eager": eager_torch_step(eager, batch, torch.optim.AdamW(eager.parameters(), lr=1e-4))}
    compile_s: dict[str, float] = {}
    for name, lowering, method in (("torchpar", "blocked", None), ("torchpar gathered", "blocked", "gathered"),
                                   ("torchpar ragged_dot", "ragged_dot", None)):
        if name not in runners_kept:
            continue
        copy_ = copy.deepcopy(model)
        linalg.GROUPED_MM, grouped_matmul.METHOD = lowering, method
        try:
            start = time.perf_counter()
            engine = torchpar.compile(copy_, torch.optim.AdamW(copy_.parameters(), lr=1e-4), example_batch=batch)
            engine.step(batch)  # traced and compiled with this lowering
            compile_s[name] = time.perf_counter() - start
        finally:
            linalg.GROUPED_MM, grouped_matmul.METHOD = "blocked", None
        runners[name] = lambda engine=engine: float(engine.step(batch))
    times = time_interleaved(runners, steps, warmup)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"experts": experts, "top_k": top_k, "median_step_s": medians,
            "ratio_to_eager": {name: medians[name] / medians["eager"] for name in medians},
            "compile_s": compile_s, "all_step_s": times}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere): the ratios to eager depend on
    it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def time_interleaved(runners: dict[str, Callable[[], Any]], steps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each runner's call, one call of each per round (machines are noisy: side by side, not in turn), the
    order reversed every other round (no runner always follows the same one), the first ``warmup`` rounds not
    kept."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(warmup + steps):
        order = list(runners.items())
        for name, run in order[::-1] if round_index % 2 else order:
            start = time.perf_counter()
            run()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


LAYOUTS = ("replicated", "tensor", "split", "auto")


def measure_sharded(experts: int, top_k: int, devices: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    """One row per :data:`LAYOUTS` entry: the model under ``ShardParallel(mesh_shape=(1, devices), experts=...)``."""
    import transformers

    import torchpar

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **CONFIG, num_local_experts=experts, num_experts_per_tok=top_k))
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    batch = {"input_ids": ids, "labels": ids}
    engines = {}
    for layout in LAYOUTS:
        copy_ = copy.deepcopy(model)
        engines[layout] = torchpar.compile(copy_, torch.optim.AdamW(copy_.parameters(), lr=1e-4), example_batch=batch,
                                           method=torchpar.ShardParallel(mesh_shape=(1, devices), experts=layout))
        engines[layout].step(batch)
    times = time_interleaved({layout: lambda engine=engine: engine.step(batch) for layout, engine in engines.items()},
                             steps, warmup)
    rows = []
    for layout, engine in engines.items():
        stage = engine.plan.stages[0]
        memory = engine.memory_stats()[0]
        grouped = sorted({label.rpartition(": ")[2] for label in stage.strategies.values() if "grouped_mm" in label})
        rows.append({"experts": experts, "layout": layout, "grouped_mm": grouped,
                     "median_step_s": statistics.median(times[layout]), "estimated_step_s": stage.estimated_cost_s,
                     "xla_bytes_per_device": memory["argument_bytes"] + memory["temp_bytes"],
                     "estimated_bytes_per_device": stage.estimated_memory_bytes, "all_step_s": times[layout]})
    return rows


def sharded_main(args: argparse.Namespace) -> int:
    import transformers

    import torchpar

    transformers.logging.set_verbosity_error()
    torchpar.init(cluster="local", num_devices=args.devices)
    print(f"Mixtral {CONFIG}, batch {BATCH}×{SEQ}, top-{args.top_k}, ShardParallel on 1×{args.devices} fake CPU "
          f"devices ({os.cpu_count()} cpus)")
    print(f"{'experts':>8} {'layout':<11}{'step ms':>9}{'est. ms':>9}{'XLA MiB':>9}{'est. MiB':>10}  grouped matmuls")
    rows = []
    for experts in (int(e) for e in args.experts.split(",")):
        for row in measure_sharded(experts, args.top_k, args.devices, args.steps, args.warmup):
            rows.append(row)
            print(f"{experts:>8} {row['layout']:<11}{row['median_step_s'] * 1e3:9.1f}{row['estimated_step_s'] * 1e3:9.1f}"
                  f"{row['xla_bytes_per_device'] / 2**20:9.1f}{row['estimated_bytes_per_device'] / 2**20:10.1f}  "
                  f"{', '.join(row['grouped_mm'])}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as handle:
            machine = {"cpus": os.cpu_count(), "cpu": cpu_model(), "torch": torch.__version__}
            json.dump({"machine": machine, "config": CONFIG,
                       "batch": [BATCH, SEQ], "devices": args.devices, "rows": rows}, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="8,32,64")
    parser.add_argument("--top-k", default="2", help="one or several (2 or 1,2,4); --devices takes one")
    parser.add_argument("--runners", default="torchpar",
                        help="one device: which of torchpar, 'torchpar gathered', 'torchpar ragged_dot' run beside eager "
                             "(comma-separated; ragged_dot's steps are slow and large, and slow the steps after them)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1, help="> 1: the layouts of the experts on that many devices")
    parser.add_argument("--json", default=None, help="default benchmarks/results/moe.json (moe_sharded.json)")
    args = parser.parse_args(argv)
    if args.devices > 1:
        args.json = args.json or "benchmarks/results/moe_sharded.json"
        args.top_k = int(args.top_k)
        return sharded_main(args)
    args.json = args.json or "benchmarks/results/moe.json"
    import transformers

    import torchpar

    transformers.logging.set_verbosity_error()
    torchpar.init(cluster="local", num_devices=1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus; Mixtral {CONFIG}, batch {BATCH}×{SEQ}")
    runners = tuple(name for name in RUNNERS if name == "eager" or name in args.runners.split(","))
    short = {"eager": "eager", "torchpar": "torchpar", "torchpar gathered": "gathered", "torchpar ragged_dot": "ragged_dot"}
    print(f"{'experts':>8}{'top-k':>6}" + "".join(f"{short[name] + ' ms':>15}" for name in runners)
          + "".join(f"{short[name] + '/eager':>18}" for name in runners[1:]))
    rows = []
    for experts in (int(e) for e in args.experts.split(",")):
        for top_k in (int(k) for k in args.top_k.split(",")):
            row = measure(experts, top_k, args.steps, args.warmup, runners)
            rows.append(row)
            m, r = row["median_step_s"], row["ratio_to_eager"]
            print(f"{experts:>8}{top_k:>6}" + "".join(f"{m[name] * 1e3:15.1f}" for name in runners)
                  + "".join(f"{r[name]:18.2f}" for name in runners[1:]), flush=True)
    first = rows[0]
    for row in rows[1:]:
        growth = {name: row["median_step_s"][name] / first["median_step_s"][name] for name in runners}
        print(f"  {first['experts']} experts top-{first['top_k']} → {row['experts']} experts top-{row['top_k']}: step ×"
              + ", ×".join(f"{value:.2f} ({name})" for name, value in growth.items()))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as handle:
            machine = {"cpus": os.cpu_count(), "cpu": cpu_model(), "torch": torch.__version__}
            json.dump({"machine": machine, "config": CONFIG,
                       "batch": [BATCH, SEQ], "rows": rows}, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
