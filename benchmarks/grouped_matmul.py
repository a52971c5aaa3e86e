"""The mixture-of-experts grouped matmul alone, forward + backward: torchpar's blocked lowering (its loop, its
gathered method and, on a GPU, its Pallas kernel ``jaxbackend/kernels/grouped_gemm.py``), ``jax.lax.ragged_dot`` and
``torch._grouped_mm``, on whatever device JAX and torch see (a GPU when there is one).

    python benchmarks/grouped_matmul.py [--experts 8,32,64] [--rows 4096] [--json out.json]

``x [rows, K] × w [E, K, N]`` with rows grouped by expert (uniformly random routing), for the Mixtral-like shapes of
``benchmarks/moe.py`` (gate/up ``K=256, N=1024``; down ``K=512, N=256``), fp32 and bf16. Medians of 10 timed calls
after warm-up, interleaved. The Pallas kernel runs only on a GPU (on the CPU Pallas only interprets; its column
reads ``-``); ``pallas_vs_torch`` is its time over ``torch._grouped_mm``'s (the goal: at most 1.5 in bf16). Also
records what XLA makes of ``ragged_dot`` on this backend: whether the optimized HLO still holds a ``ragged-dot`` (a
native kernel) or only dense ``dot``s (the expansion), and the FLOPs XLA counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxbackend.ops.grouped_matmul import blocked_ragged_dot

SHAPES = {"gate_up": (256, 1024), "down": (512, 256)}


def _time(fn, repeats: int = 10) -> float:
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(rows: int, experts: int, k: int, n: int, dtype: str) -> dict:
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.integers(0, experts, rows), minlength=experts).astype(np.int32)
    jdtype = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    x = jnp.asarray(rng.standard_normal((rows, k)), jdtype)
    w = jnp.asarray(rng.standard_normal((experts, k, n)) * 0.05, jdtype)
    sizes = jnp.asarray(counts)
    out: dict = {"rows": rows, "experts": experts, "k": k, "n": n, "dtype": dtype}
    runners = [("loop", lambda x, w: blocked_ragged_dot(x, w, sizes, method="loop")),
               ("gathered", lambda x, w: blocked_ragged_dot(x, w, sizes, method="gathered")),
               ("ragged_dot", lambda x, w: jax.lax.ragged_dot(x, w, sizes))]
    if jax.default_backend() == "gpu":
        runners.append(("pallas", lambda x, w: blocked_ragged_dot(x, w, sizes, method="pallas")))
    for name, product in runners:
        step = jax.jit(jax.grad(lambda x, w: product(x, w).astype(jnp.float32).sum(), argnums=(0, 1)))
        try:
            out[f"{name}_ms"] = 1e3 * _time(lambda: jax.block_until_ready(step(x, w)))
        except Exception as error:  # a kernel that does not compile here is a result, not the end of the run
            if name != "pallas":
                raise
            out[f"{name}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        if name == "ragged_dot":
            compiled = jax.jit(product).lower(x, w).compile()
            text = compiled.as_text()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            # an HLO instruction, not the op name JAX leaves in every expanded op's metadata
            out["ragged_dot_hlo_keeps_ragged_dot"] = " ragged-dot(" in text
            out["ragged_dot_hlo_custom_calls"] = sorted({line.split("custom_call_target=")[1].split(",")[0]
                                                         for line in text.splitlines()
                                                         if "custom_call_target=" in line})
            out["ragged_dot_forward_flops"] = float(cost.get("flops", float("nan")))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    tx = torch.tensor(np.asarray(x, np.float32), dtype=tdtype, device=device, requires_grad=True)
    tw = torch.tensor(np.asarray(w, np.float32), dtype=tdtype, device=device, requires_grad=True)
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=device)

    def torch_step() -> None:
        tx.grad = tw.grad = None
        torch._grouped_mm(tx, tw, offs=offs).float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    try:
        out["torch_grouped_mm_ms"] = 1e3 * _time(torch_step)
    except Exception as error:  # torch._grouped_mm's dtype / device support varies by version
        out["torch_grouped_mm_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    if "pallas_ms" in out and "torch_grouped_mm_ms" in out:
        out["pallas_vs_torch"] = out["pallas_ms"] / out["torch_grouped_mm_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="8,32,64")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--json", default="benchmarks/results/grouped_matmul.json")
    args = parser.parse_args(argv)
    devices = jax.devices()
    print(f"jax {jax.__version__} on {devices[0].device_kind} ({jax.default_backend()}), torch {torch.__version__}"
          f" ({'cuda: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'})")
    print(f"{'shape':>8}{'dtype':>6}{'E':>4}{'loop ms':>10}{'gathered ms':>13}{'ragged_dot ms':>15}{'pallas ms':>11}"
          f"{'torch ms':>10}{'rd keeps ragged-dot':>21}")
    rows = []
    for dtype in args.dtypes.split(","):
        for shape, (k, n) in SHAPES.items():
            for experts in (int(e) for e in args.experts.split(",")):
                row = measure(args.rows, experts, k, n, dtype) | {"shape": shape}
                rows.append(row)
                torch_ms = f"{row['torch_grouped_mm_ms']:10.2f}" if "torch_grouped_mm_ms" in row else f"{'-':>10}"
                pallas_ms = f"{row['pallas_ms']:11.2f}" if "pallas_ms" in row else f"{'-':>11}"
                print(f"{shape:>8}{dtype:>6}{experts:>4}{row['loop_ms']:10.2f}{row['gathered_ms']:13.2f}"
                      f"{row['ragged_dot_ms']:15.2f}{pallas_ms}"
                      f"{torch_ms}{str(row['ragged_dot_hlo_keeps_ragged_dot']):>21}", flush=True)
                if "pallas_error" in row:
                    print(f"    pallas: {row['pallas_error']}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump({"jax": jax.__version__, "device": devices[0].device_kind, "backend": jax.default_backend(),
                       "torch": torch.__version__, "rows": rows}, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
