"""Mixture-of-experts step time on one device: torchpar against PyTorch eager, as the number of experts grows.

    python benchmarks/moe.py [--experts 8,32,64] [--top-k 2] [--steps 5] [--warmup 2] [--json out.json]

HF ``MixtralForCausalLM`` (2 layers, hidden 256, expert hidden 512, 4 heads, vocabulary 1,024; its default
``grouped_mm`` experts path), batch 8 × 256, AdamW, fp32. Three runners train the same model, timed interleaved
(one step of each per round, medians): PyTorch eager; torchpar with ``_grouped_mm`` lowered in blocks of one
expert's rows (``jaxbackend/ops/grouped_matmul.py``, the default); torchpar with ``jax.lax.ragged_dot`` as XLA's CPU
backend expands it (every expert computed on every row). The work of an exact grouped matmul grows with the rows
(tokens × top-k), not with the number of experts: the table shows how each runner's step grows from the first
expert count. Expert parallelism over several devices is the planner's (issue 29); this is the one-device kernel.
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


def measure(experts: int, top_k: int, steps: int, warmup: int) -> dict[str, Any]:
    import transformers

    import torchpar
    from jaxbackend.ops import linalg

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **CONFIG, num_local_experts=experts, num_experts_per_tok=top_k))
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    batch = {"input_ids": ids, "labels": ids}
    eager = copy.deepcopy(model)
    runners: dict[str, Callable[[], float]] = {
        "eager": eager_torch_step(eager, batch, torch.optim.AdamW(eager.parameters(), lr=1e-4))}
    compile_s: dict[str, float] = {}
    for name, lowering in (("torchpar", "blocked"), ("torchpar ragged_dot", "ragged_dot")):
        copy_ = copy.deepcopy(model)
        linalg.GROUPED_MM = lowering
        try:
            start = time.perf_counter()
            engine = torchpar.compile(copy_, torch.optim.AdamW(copy_.parameters(), lr=1e-4), example_batch=batch)
            engine.step(batch)  # traced and compiled with this lowering
            compile_s[name] = time.perf_counter() - start
        finally:
            linalg.GROUPED_MM = "blocked"
        runners[name] = lambda engine=engine: float(engine.step(batch))
    times: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(warmup + steps):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"experts": experts, "top_k": top_k, "median_step_s": medians,
            "ratio_to_eager": {name: medians[name] / medians["eager"] for name in medians},
            "compile_s": compile_s, "all_step_s": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="8,32,64")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default="benchmarks/results/moe.json")
    args = parser.parse_args(argv)
    import transformers

    import torchpar

    transformers.logging.set_verbosity_error()
    torchpar.init(cluster="local", num_devices=1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus; Mixtral {CONFIG}, batch {BATCH}×{SEQ}, top-{args.top_k}")
    print(f"{'experts':>8}{'eager ms':>11}{'torchpar ms':>13}{'ragged_dot ms':>15}{'tp/eager':>10}{'rd/eager':>10}")
    rows = []
    for experts in (int(e) for e in args.experts.split(",")):
        row = measure(experts, args.top_k, args.steps, args.warmup)
        rows.append(row)
        m, r = row["median_step_s"], row["ratio_to_eager"]
        print(f"{experts:>8}{m['eager'] * 1e3:11.1f}{m['torchpar'] * 1e3:13.1f}{m['torchpar ragged_dot'] * 1e3:15.1f}"
              f"{r['torchpar']:10.2f}{r['torchpar ragged_dot']:10.2f}", flush=True)
    first = rows[0]["median_step_s"]
    for row in rows[1:]:
        growth = {name: row["median_step_s"][name] / first[name] for name in first}
        print(f"  {rows[0]['experts']} → {row['experts']} experts: step ×" + ", ×".join(
            f"{value:.2f} ({name})" for name, value in growth.items()))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump({"machine": {"cpus": os.cpu_count(), "torch": torch.__version__}, "config": CONFIG,
                       "batch": [BATCH, SEQ], "rows": rows}, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
