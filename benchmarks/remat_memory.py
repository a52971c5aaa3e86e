"""Activation checkpointing: XLA's memory analysis of the compiled training step per ``remat`` option.

    python benchmarks/remat_memory.py [--models gpt2-124m,llama-small] [--batch 4 --seq 512] [--json out.json]
    python benchmarks/remat_memory.py --models gpt2-124m --losses 3   # also train 3 steps per option and compare

For each model the whole training step (forward, ``jax.grad`` backward) is lowered once per option
(``none``, ``layers``, ``selective``) from the same capture and compiled for this machine's backend, without
running it; the table gives XLA's temporary bytes (``memory_analysis().temp_size_in_bytes``: activations kept for
the backward and every other intermediate at the step's peak), the ratio to ``none`` and the compile seconds.
Parameters, gradients and optimizer state are arguments/outputs of the step, not temporaries, so the ratio
is what remat changes. Measured side by side in one process; JAX sees shapes only (``jax.ShapeDtypeStruct``).

``--losses N`` also trains each model ``N`` AdamW steps per option with ``torchpar.compile(..., remat=option)`` on one
device from the same initial weights and batch, and reports each option's largest per-step relative loss
difference to ``none`` (column ``max rel Δloss``; 0 means bit-identical).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2-124m": ("GPT2", {}),  # 12 layers × 768, vocab 50257
    "gpt2-small": ("GPT2", {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 256}),
    "llama-small": ("Llama", {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192}),
}
OPTIONS = ("none", "layers", "selective")


def build(name: str, batch: int, seq: int) -> tuple[torch.nn.Module, dict]:
    import transformers

    family, overrides = MODELS[name]
    config_class = getattr(transformers, f"{family}Config")
    model_class = getattr(transformers, f"{family}LMHeadModel" if family == "GPT2" else f"{family}ForCausalLM")
    dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if family == "GPT2" else {}
    config = config_class(**{**dropout, **overrides, **({"n_positions": max(seq, 1024)} if family == "GPT2" else {})})
    model = model_class(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


def measure(name: str, batch: int, seq: int) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from jaxbackend.lower import lower
    from torchpar.capture.export import capture_train_step
    from torchpar.runtime.train_step import remat_groups

    model, example = build(name, batch, seq)
    graph = capture_train_step(model, example).graph
    params = {n: jax.ShapeDtypeStruct(tuple(p.shape), jnp.float32) for n, p in model.named_parameters()}
    buffers = {n: jax.ShapeDtypeStruct(tuple(b.shape), jnp.float32 if b.is_floating_point() else jnp.int32)
               for n, b in model.named_buffers()}
    inputs = [jax.ShapeDtypeStruct((batch, seq), jnp.int32)] * 2
    rows = []
    for option in OPTIONS:
        start = time.perf_counter()
        run = lower(graph, remat=remat_groups(graph, option))

        def loss(p, b, i):
            return run(p, b, i, jax.random.key(0))[0][0]

        step = jax.jit(jax.value_and_grad(loss))
        compiled = step.lower(params, buffers, inputs).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        rows.append({"model": name, "batch": batch, "seq": seq, "remat": option, "temp_bytes": int(temp),
                     "compile_s": round(time.perf_counter() - start, 2)})
    base = rows[0]["temp_bytes"]
    for row in rows:
        row["ratio_to_none"] = round(row["temp_bytes"] / base, 3)
    return rows


def train_losses(name: str, batch: int, seq: int, steps: int) -> dict[str, list[float]]:
    """Per remat option: the losses of ``steps`` AdamW steps of ``name`` on one device, from the same weights."""
    import copy

    import torchpar

    torch.manual_seed(0)
    model, example = build(name, batch, seq)
    losses: dict[str, list[float]] = {}
    for option in OPTIONS:
        replica = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(replica.parameters(), lr=1e-4)
        with torchpar.compile(replica, optimizer, example_batch=example, remat=option) as engine:
            losses[option] = [engine.step(example).item() for _ in range(steps)]
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2-124m,llama-small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--losses", type=int, default=0, help="also train this many steps per option")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "remat_memory.json"))
    args = parser.parse_args()
    import torchpar

    torchpar.init(cluster="local", num_devices=1)
    import jax

    rows = [row for name in args.models.split(",") for row in measure(name, args.batch, args.seq)]
    if args.losses:
        for name in args.models.split(","):
            losses = train_losses(name, args.batch, args.seq, args.losses)
            for row in rows:
                if row["model"] == name:
                    row["losses"] = losses[row["remat"]]
                    row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses[row["remat"]],
                                                                                        losses["none"]))
    print(f"backend: {jax.default_backend()}, jax {jax.__version__}")
    print(f"{'model':<12} {'tokens':>9} {'remat':<10} {'temp MiB':>9} {'× none':>7} {'compile s':>9}"
          + (f" {'max rel Δloss':>14}" if args.losses else ""))
    for row in rows:
        print(f"{row['model']:<12} {row['batch']}×{row['seq']:<7} {row['remat']:<10} "
              f"{row['temp_bytes'] / 2**20:>9.1f} {row['ratio_to_none']:>7.3f} {row['compile_s']:>9.1f}"
              + (f" {row['max_rel_loss_diff']:>14.2e}" if "max_rel_loss_diff" in row else ""))
    with open(args.json, "w") as f:
        json.dump({"backend": jax.default_backend(), "jax": jax.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
