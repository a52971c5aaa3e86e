"""Long sequences split over devices (context parallelism): memory per device and step time against the sequence
length, for 1, 2 and 4 context ranks.

    python benchmarks/long_context.py [--lengths 1024,2048,4096,8192] [--steps 3] [--warmup 1] [--json out.json]
    python benchmarks/long_context.py --gpt2 8192 [--json out.json]

Two tables. **Model**: an HF Llama (2 layers, hidden 64, 2 query heads, 1 key/value head, vocabulary 128), batch 1,
AdamW, fp32, trained on one device (the whole-sequence attention: matmul, softmax, matmul, keeping the ``L × S``
probabilities for the backward) and under ``ShardParallel(mesh_shape=(1, C), context=...)`` with the ring and the
all-gather (``jaxbackend/ops/context_attention.py``); per row XLA's bytes per device (arguments + outputs − aliased +
temporaries of the compiled step), the plan's estimate beside it, and the median step time (runners of one length
timed interleaved). **Attention**: the context-parallel attention alone (forward + backward of ``[1, 8, T, 64]``
causal, ring), on 1, 2 and 4 devices: XLA's temporaries per device, whose share of one device's is the activation
memory that context parallelism divides (the blocks are computed in tiles of query rows, so it is linear in ``T/C``,
plus the ring's K/V buffer: two K|V chunks of ``2·B·H·(T/C)·D·4`` bytes — forward, the chunk in flight beside the own
one; backward, the moving chunk and its fp32 gradient accumulator), against the target ``1/C`` of one device's plus
that buffer (the issue's "within 10 % of 1, ½, ¼, plus the K/V buffer").

    python benchmarks/long_context.py --attention-only [--lengths ...] [--json out.json] Fake CPU devices share this machine's cores: times compare the rows of one length, not
devices.

``--gpt2 T``: GPT-2 (4 layers, n_embd 256, 8 heads, vocabulary 1,024), batch 1 × T, AdamW, 3 steps with PyTorch eager
and with ``ShardParallel(mesh_shape=(1, 4), context=...)`` for the ring and the all-gather: the largest relative loss
difference, and in each compiled step's forward (XLA's op metadata: not a ``transpose``) the ring's moves per
attention (permutes ``i → i+1`` times the loop trips) and the all-gathers inside the attention's ``shard_map``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1)
RUNNERS = (("one device", 1, None), ("ring", 2, "ring"), ("ring", 4, "ring"), ("allgather", 4, "allgather"))


def _xla_bytes(engine) -> int:
    memory = engine.memory_stats()[0]
    return memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"] + memory["temp_bytes"]


def measure_model(length: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    import transformers

    import torchpar
    from moe import time_interleaved  # benchmarks/ is on sys.path when a script runs

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, max_position_embeddings=length))
    ids = torch.randint(0, CONFIG["vocab_size"], (1, length))
    batch = {"input_ids": ids, "labels": ids}
    engines = {}
    for name, ranks, variant in RUNNERS:
        copy_ = copy.deepcopy(model)
        method = None if ranks == 1 else torchpar.ShardParallel(mesh_shape=(1, ranks), context=variant)
        engine = torchpar.compile(copy_, torch.optim.AdamW(copy_.parameters(), lr=1e-4), example_batch=batch,
                                  method=method)
        engine.step(batch)
        engines[(name, ranks)] = engine
    times = time_interleaved({key: (lambda engine=engine: engine.step(batch)) for key, engine in engines.items()},
                             steps, warmup)
    one = _xla_bytes(engines[("one device", 1)])
    rows = []
    for (name, ranks), engine in engines.items():
        stage = engine.plan.stages[0]
        measured = _xla_bytes(engine)
        rows.append({"length": length, "runner": name, "context_ranks": ranks, "xla_bytes_per_device": measured,
                     "share_of_one_device": measured / one, "estimated_bytes_per_device": stage.estimated_memory_bytes,
                     "median_step_s": statistics.median(times[(name, ranks)]), "all_step_s": times[(name, ranks)]})
    return rows


def measure_attention(length: int) -> list[dict[str, Any]]:
    """XLA's temporaries per device of the ring attention's forward + backward at 1, 2 and 4 context ranks."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxbackend.ops.context_attention import ContextSplit, split_attention
    from jaxbackend.sharding import make_mesh

    shape = (1, 8, length, 64)
    rows = []
    for ranks in (1, 2, 4):
        mesh = make_mesh((1, ranks))
        sharding = NamedSharding(mesh, PartitionSpec(None, None, "d1", None))
        split = ContextSplit(("d1",), ranks, "ring", True, 0.125)
        loss = lambda q, k, v: jnp.sum(split_attention(q, k, v, [sharding] * 3, split))  # noqa: E731
        arrays = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)] * 3
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*arrays).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        block = 2 * shape[0] * shape[1] * (length // ranks) * shape[3] * 4  # one device's K|V chunk, fp32
        rows.append({"length": length, "context_ranks": ranks, "temp_bytes_per_device": temp,
                     "kv_buffer_bytes": 0 if ranks == 1 else 2 * block})
    one = rows[0]["temp_bytes_per_device"]
    for row in rows:
        row["share_of_one_rank"] = row["temp_bytes_per_device"] / one
        row["target_share"] = 1 / row["context_ranks"] + row["kv_buffer_bytes"] / one
        row["within_10_percent"] = row["share_of_one_rank"] <= 1.1 * row["target_share"]
    return rows


def check_gpt2(length: int) -> list[dict[str, Any]]:
    """The ``--gpt2`` rows (module docstring)."""
    import re

    import transformers

    import torchpar
    from torchpar.report.hlo import collectives

    def model():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=1024, n_positions=length, n_embd=256, n_layer=4, n_head=8, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))

    ids = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    reference = model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    expected = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = reference(**batch).loss
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    ring = sorted([i, (i + 1) % 4] for i in range(4))
    rows = []
    for variant in ("ring", "allgather"):
        copy_ = model()
        engine = torchpar.compile(copy_, torch.optim.AdamW(copy_.parameters(), lr=1e-3), example_batch=batch,
                                  method=torchpar.ShardParallel(mesh_shape=(1, 4), context=variant))
        losses = [engine.step(batch).item() for _ in range(3)]
        forward = [c for c in collectives(engine.hlo_text()[0])
                   if (name := re.search(r'op_name="([^"]*)"', c.line)) and "transpose(" not in name.group(1)]
        attentions = sum(1 for label in engine.plan.stages[0].strategies.values() if "attention" in label)
        rows.append({"length": length, "variant": variant, "losses": losses, "pytorch_losses": expected,
                     "max_relative_loss_difference": max(abs(a - b) / abs(b) for a, b in zip(losses, expected)),
                     "ring_moves_per_attention_forward": sum(
                         c.runs for c in forward if c.kind == "collective-permute" and sorted(c.groups) == ring)
                     / attentions,
                     "attention_all_gathers_forward": sum(1 for c in forward if c.kind == "all-gather"
                                                          and "shard_map" in c.line) / attentions})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--gpt2", type=int, default=None, help="the GPT-2 check at this sequence length")
    parser.add_argument("--attention-only", action="store_true", help="only the attention table (no training)")
    args = parser.parse_args()
    import transformers

    import torchpar

    torchpar.init(num_devices=4)
    transformers.logging.set_verbosity_error()
    if args.gpt2:
        rows = check_gpt2(args.gpt2)
        print(f"{'T':>6} {'variant':>10} {'max rel. loss diff':>19} {'ring moves / attn fwd':>22} "
              f"{'K/V gathers / attn fwd':>23}")
        for row in rows:
            print(f"{row['length']:>6} {row['variant']:>10} {row['max_relative_loss_difference']:>19.1e} "
                  f"{row['ring_moves_per_attention_forward']:>22.1f} {row['attention_all_gathers_forward']:>23.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": platform.processor() or platform.machine(), "gpt2": rows}, f, indent=1)
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    model_rows, attention_rows = [], []
    print(f"{'T':>6} {'runner':>11} {'C':>2} {'XLA MB/dev':>11} {'÷ 1 dev':>8} {'est. MB':>8} {'step ms':>9}")
    for length in [] if args.attention_only else lengths:
        for row in measure_model(length, args.steps, args.warmup):
            model_rows.append(row)
            print(f"{length:>6} {row['runner']:>11} {row['context_ranks']:>2} "
                  f"{row['xla_bytes_per_device'] / 1e6:>11.1f} "
                  f"{row['share_of_one_device']:>8.3f} {row['estimated_bytes_per_device'] / 1e6:>8.1f} "
                  f"{row['median_step_s'] * 1e3:>9.1f}")
    print(f"\n{'T':>6} {'C':>2} {'attention temp MB/dev':>22} {'÷ C=1':>7} {'1/C':>6} {'K/V MB':>7} "
          f"{'1/C + K/V':>10} {'≤ 1.1×':>7}")
    for length in lengths:
        for row in measure_attention(length):
            attention_rows.append(row)
            print(f"{length:>6} {row['context_ranks']:>2} {row['temp_bytes_per_device'] / 1e6:>22.1f} "
                  f"{row['share_of_one_rank']:>7.3f} {1 / row['context_ranks']:>6.3f} "
                  f"{row['kv_buffer_bytes'] / 1e6:>7.1f} {row['target_share']:>10.3f} "
                  f"{'yes' if row['within_10_percent'] else 'no':>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "model": model_rows, "attention": attention_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
