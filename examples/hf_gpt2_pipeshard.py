"""Plan and train a HuggingFace GPT-2 with PipeshardParallel: automatic layers, stages and shardings.

    python examples/hf_gpt2_pipeshard.py [--runtime local|ray] [--layers 4] [--micro-batches 4] [--steps 5]

Operator clustering cuts the model into layers, the stage DP places layer ranges on submeshes of
2 simulated hosts × 4 devices, and the sharding ILP plans each stage. The plan (with the runners-up the
DP weighed) is printed before training.
"""

from __future__ import annotations

import argparse
import json

import torchpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=("local", "ray"), default="local")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torchpar.init(cluster=args.runtime, num_hosts=2, devices_per_host=4)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (16, 32))
    batch = {"input_ids": ids, "labels": ids}
    method = torchpar.PipeshardParallel(num_micro_batches=args.micro_batches,
                                        layer_option=torchpar.AutoLayerOption(layer_num=args.layers),
                                        stage_option="auto")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torchpar.compile(model, optimizer, example_batch=batch, method=method) as engine:  # closed on exit
        plan = engine.plan
        print(plan.summary())
        print("chosen partition:", json.dumps(plan.solver.get("stage_partition"), indent=1)[:800])
        for step in range(args.steps):
            print(f"step {step}  loss {engine.step(batch):.4f}")


if __name__ == "__main__":
    main()
