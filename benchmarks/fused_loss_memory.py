"""The LM head and cross-entropy in chunks: XLA's temporary bytes of the compiled training step, fused vs unfused.

    python benchmarks/fused_loss_memory.py                           # GPT-2 124M (vocab 50,257), batch 8 × 1024
    python benchmarks/fused_loss_memory.py --models gpt2-124m,llama-small --batch 4 --seq 512

For each model (and each ``--remat`` policy) the whole training step (forward, ``jax.grad`` backward; parameters, gradients and optimizer state are
arguments and outputs, not temporaries) is lowered twice from the same capture — the loss chain as captured, and
computed in chunks (:func:`jaxbackend.rewrites.fuse_linear_cross_entropy`, forced on) — each with the attention
whole and in tiles of query rows (``jaxbackend.ops.attention._attend_in_row_tiles``, forced on), and compiled for this
machine's backend without running; the table gives ``memory_analysis().temp_size_in_bytes`` of each and the cut the
fused loss makes, and ``--check`` the loss and gradient differences of the two on one batch (evaluated: slow for 124M
on a CPU).

Prints a table and writes ``benchmarks/results/fused_loss_memory.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2-124m": ("GPT2", {}),  # 12 layers × 768, vocab 50257
    "gpt2-124m-nodrop": ("GPT2", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "gpt2-small": ("GPT2", {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 8192}),
    "llama-small": ("Llama", {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000}),
}


def _build(name: str, batch: int, seq: int):
    import torch
    import transformers

    family, overrides = MODELS[name]
    config_class = getattr(transformers, f"{family}Config")
    model_class = getattr(transformers, f"{family}LMHeadModel" if family == "GPT2" else f"{family}ForCausalLM")
    extra = {"n_positions": max(seq, 1024)} if family == "GPT2" else {}
    torch.manual_seed(0)
    model = model_class(config_class(**{**overrides, **extra}))
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


@contextlib.contextmanager
def _choices(fused: bool, tiles: bool, chunk_bytes: int | None):
    """The loss chain fused or not and the attention in row tiles or whole (forced), while a step is lowered and
    traced (the attention reads its switch while JAX traces)."""
    from jaxbackend import rewrites
    from jaxbackend.ops import attention

    saved = rewrites.FUSED_LOSS_MIN_BYTES, rewrites.FUSED_LOSS_CHUNK_BYTES, attention.ROW_TILED_MIN_BYTES
    rewrites.FUSED_LOSS_MIN_BYTES = 0 if fused else 1 << 62
    rewrites.FUSED_LOSS_CHUNK_BYTES = chunk_bytes or saved[1]
    attention.ROW_TILED_MIN_BYTES = 0 if tiles else 1 << 62
    try:
        yield
    finally:
        rewrites.FUSED_LOSS_MIN_BYTES, rewrites.FUSED_LOSS_CHUNK_BYTES, attention.ROW_TILED_MIN_BYTES = saved


def measure(
    name: str, batch: int, seq: int, check: bool, chunk_bytes: int | None = None, remat: str = "none"
) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from jaxbackend import rewrites
    from jaxbackend.lower import lower
    from torchpar.capture.export import capture_train_step
    from torchpar.runtime.train_step import remat_groups

    model, example = _build(name, batch, seq)
    graph = capture_train_step(model, example).graph
    chains = rewrites._loss_chains(graph)
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    buffers = {n: jnp.asarray(b.numpy()) for n, b in model.named_buffers()}
    inputs = [jnp.asarray(v.numpy()).astype(jnp.int32) for v in example.values()]
    row: dict[str, Any] = {"model": name, "batch": batch, "seq": seq, "remat": remat, "chains": len(chains)}
    results = {}
    for tiles in (False, True):
        for fused in (False, True):
            variant = ("fused" if fused else "unfused") + ("_tiled" if tiles else "")
            start = time.perf_counter()
            with _choices(fused, tiles, chunk_bytes):
                run = lower(graph, remat=remat_groups(graph, remat))

                def loss(p, run=run):
                    return run(p, buffers, inputs, jax.random.key(0))[0][0]

                compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
            row[f"{variant}_temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
            row[f"{variant}_compile_s"] = round(time.perf_counter() - start, 1)
            if check and not tiles:
                results[variant] = compiled(params)
    row["temp_cut"] = round(1 - row["fused_temp_bytes"] / row["unfused_temp_bytes"], 4)
    row["temp_cut_tiled"] = round(1 - row["fused_tiled_temp_bytes"] / row["unfused_tiled_temp_bytes"], 4)
    row["temp_cut_both"] = round(1 - row["fused_tiled_temp_bytes"] / row["unfused_temp_bytes"], 4)
    if check:
        (loss_u, grads_u), (loss_f, grads_f) = results["unfused"], results["fused"]
        row["loss_abs_diff"] = float(abs(loss_u - loss_f))
        row["grad_max_abs_diff"] = max(float(jnp.max(jnp.abs(grads_u[k] - grads_f[k]))) for k in grads_u)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2-124m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--chunk-mib", type=float, default=None,
                        help="logits per chunk (default: jaxbackend.rewrites.FUSED_LOSS_CHUNK_BYTES)")
    parser.add_argument("--remat", default="none",
                        help="comma-separated activation checkpointing policies to measure under (none, selective, "
                             "layers: torchpar.planner.remat)")
    parser.add_argument("--check", action="store_true", help="also run both steps once and compare them")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "fused_loss_memory.json"))
    args = parser.parse_args()
    import torchpar

    torchpar.init(cluster="local", num_devices=1)
    import jax
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    print(f"{'model':<18}{'batch':>9}{'remat':>10}{'unfused GB':>12}{'fused GB':>10}{'cut':>7}"
          f"{'tiled attention: unfused GB':>29}{'fused GB':>10}{'cut':>7}")
    rows = []
    chunk_bytes = int(args.chunk_mib * 2**20) if args.chunk_mib else None
    for name, remat in ((n, r) for n in args.models.split(",") for r in args.remat.split(",")):
        row = measure(name, args.batch, args.seq, args.check, chunk_bytes, remat)
        rows.append(row)
        shape = f"{args.batch}x{args.seq}"
        print(f"{name:<18}{shape:>9}{remat:>10}{row['unfused_temp_bytes'] / 1e9:12.3f}"
              f"{row['fused_temp_bytes'] / 1e9:10.3f}{row['temp_cut']:7.1%}{row['unfused_tiled_temp_bytes'] / 1e9:29.3f}"
              f"{row['fused_tiled_temp_bytes'] / 1e9:10.3f}{row['temp_cut_tiled']:7.1%}", flush=True)
        if args.check:
            print(f"  loss |Δ| {row['loss_abs_diff']:.2e}, gradients max |Δ| {row['grad_max_abs_diff']:.2e}")
    meta = {"torch": torch.__version__, "jax": jax.__version__, "device": str(jax.devices()[0]),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "command": " ".join(sys.argv)}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
