"""One GPU: the context-parallel attention's blocks (XLA and Pallas) against cuDNN's whole-sequence attention.

    python benchmarks/attention_gpu.py [--lengths 4096,8192,16384] [--steps 10] [--json out.json]

Causal attention ``[1, 8, T, 128]`` in bf16, forward + backward (the sum of the output differentiated with respect to
q, k and v), on one device: ``jax.nn.dot_product_attention(implementation="cudnn")`` (a fused flash kernel),
``implementation="xla"`` (matmul, softmax, matmul: the ``T × T`` probabilities materialized), and torchpar's
context attention on a one-device mesh (``jaxbackend/ops/context_attention.py``: the blocks a ring step computes,
log-sum-exp merges, its own VJP) — the per-device kernel a ring over several devices runs on each of its steps — with
its blocks computed by XLA (``BLOCK_KERNEL = "xla"``: tiles of 256 query rows) and by the Pallas flash-attention
kernel (``"pallas"``, the default on a GPU: ``jaxbackend/kernels/flash_attention.py``, Triton), and that kernel alone
(``flash_block``, causal, its ``custom_vjp`` through the output). Per row: median step time, XLA's temporary bytes,
and the largest difference of the output and the gradients from cuDNN's (bf16). torchpar does not call cuDNN per
block (JAX's cuDNN attention drops the gradient of its log-sum-exp output, jax#28408), so this measures what the
blocks cost against it. The Pallas rows have not been measured yet (written without a GPU: a first run may show
that the Triton kernels fail to compile, a row's "failed:" line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxbackend.kernels.flash_attention import flash_block
    from jaxbackend.ops import context_attention
    from jaxbackend.ops.context_attention import ContextSplit, split_attention
    from jaxbackend.sharding import make_mesh

    mesh = make_mesh((1, 1))
    sharding = NamedSharding(mesh, PartitionSpec())
    rows = []
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    print(f"{'T':>6} {'kernel':>20} {'ms':>8} {'temp MiB':>9} {'max |Δ| vs cudnn':>17}")
    for length in (int(x) for x in args.lengths.split(",")):
        shape = (1, 8, length, 128)
        scale = 1.0 / 128 ** 0.5
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
        split = ContextSplit(("d1",), 1, "ring", True, scale)
        kernels = {
            "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
                q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), is_causal=True, scale=scale,
                implementation="cudnn").swapaxes(1, 2),
            "xla": lambda q, k, v: jax.nn.dot_product_attention(
                q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), is_causal=True, scale=scale,
                implementation="xla").swapaxes(1, 2),
            "torchpar xla blocks": lambda q, k, v: split_attention(q, k, v, [sharding] * 3, split),
            "torchpar pallas blocks": lambda q, k, v: split_attention(q, k, v, [sharding] * 3, split),
            "pallas flash_block": lambda q, k, v: flash_block(q, k, v, scale=scale, offset=0)[0],
        }
        block_kernels = {"torchpar xla blocks": "xla", "torchpar pallas blocks": "pallas"}  # read while tracing
        results = {}
        for name, kernel in kernels.items():
            context_attention.BLOCK_KERNEL = block_kernels.get(name)
            def loss(q, k, v, kernel=kernel):
                out = kernel(q, k, v)
                return jnp.sum(out.astype(jnp.float32)), out

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
            try:
                compiled = step.lower(q, k, v).compile()
                (_, out), grads = compiled(q, k, v)
                jax.block_until_ready(grads)
            except Exception as error:  # no cuDNN attention for this shape or device; out of memory
                print(f"{length:>6} {name:>20} failed: {str(error).splitlines()[0][:120]}")
                rows.append({"length": length, "kernel": name, "error": str(error).splitlines()[0]})
                continue
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                jax.block_until_ready(compiled(q, k, v))
                times.append(time.perf_counter() - start)
            results[name] = (out, grads)
            temp = compiled.memory_analysis().temp_size_in_bytes
            rows.append({"length": length, "kernel": name, "median_ms": statistics.median(times) * 1e3,
                         "temp_bytes": temp})
        base = results.get("cudnn")
        for row in rows:
            if row["length"] != length or "error" in row:
                continue
            if base is not None and row["kernel"] in results:
                out, grads = results[row["kernel"]]
                diffs = [jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                         for a, b in zip((out, *grads), (base[0], *base[1]))]
                row["max_abs_difference_vs_cudnn"] = float(max(diffs))
            print(f"{length:>6} {row['kernel']:>20} {row['median_ms']:>8.2f} {row['temp_bytes'] / 2**20:>9.1f} "
                  f"{row.get('max_abs_difference_vs_cudnn', float('nan')):>17.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "shape": "[1, 8, T, 128] bf16",
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
