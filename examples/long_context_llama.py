"""Train a Llama on one long sequence split over 4 (fake CPU) devices: context parallelism found by the planner.

    python examples/long_context_llama.py [--seq-len 4096] [--steps 3] [--devices 4] [--budget-share 0.35]

Batch 1, 2 query heads and 1 key/value head: neither the batch nor the heads split 4 ways, and the whole-sequence
attention keeps ``L × L`` probabilities for its backward. Under a memory budget of ``--budget-share`` of the
one-device step, ``ShardParallel`` splits every attention's sequence (keys and values passed around a ring of
devices, zig-zag chunks for the causal mask) and the matmuls around it split their tokens. The example prints the
plan's sequence lines, the losses beside the one-device step's, and XLA's bytes per device against one device's.
"""

from __future__ import annotations

import argparse

import torchpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--budget-share", type=float, default=0.35)
    args = parser.parse_args()
    torchpar.init(cluster="local", num_devices=args.devices)  # before anything imports JAX

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                      max_position_embeddings=args.seq_len)
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    def engine_for(method):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        return torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch,
                                method=method)

    def xla_bytes(engine) -> int:
        memory = engine.memory_stats()[0]
        return memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"] + memory["temp_bytes"]

    one = engine_for(None)
    one_losses = [one.step(batch) for _ in range(args.steps)]
    budget = int(args.budget_share * xla_bytes(one))
    split = engine_for(torchpar.ShardParallel(mesh_shape=(1, args.devices), memory_budget=budget))
    print("\n".join(line for line in split.plan.summary().splitlines() if "sequence:" in line or "est. memory" in line))
    for step, expected in enumerate(one_losses):
        print(f"step {step}  loss {split.step(batch):.6f}  (one device {expected:.6f})")
    print(f"XLA bytes per device: {xla_bytes(split) / 1e6:.1f} MB, one device {xla_bytes(one) / 1e6:.1f} MB "
          f"({xla_bytes(split) / xla_bytes(one):.0%}); budget {budget / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
