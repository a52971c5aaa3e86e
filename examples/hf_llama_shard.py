"""Train a tiny HuggingFace Llama with ShardParallel on 8 (fake CPU) devices and show the plan.

    python examples/hf_llama_shard.py [--steps 10] [--devices 8]

The sharding ILP picks a layout for every tensor on each logical mesh shape of the devices and keeps
the cheapest; the printed plan lists every parameter's spec (``S1 R`` = dim 0 split over mesh axis 1).
"""

from __future__ import annotations

import argparse

import torchpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    torchpar.init(cluster="local", num_devices=args.devices)  # before anything imports JAX

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (8, 32))
    batch = {"input_ids": ids, "labels": ids}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    engine = torchpar.compile(model, optimizer, example_batch=batch, method=torchpar.ShardParallel())
    print(engine.plan.summary())
    for step in range(args.steps):
        print(f"step {step:2d}  loss {engine.step(batch):.4f}")
    engine.sync_to_torch()  # the trained weights are back in `model`


if __name__ == "__main__":
    main()
