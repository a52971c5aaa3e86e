"""Train a tiny HuggingFace ViT with DataParallel on 4 (fake CPU) devices and check it against one device.

    python examples/vit_data_parallel.py [--steps 10]
"""

from __future__ import annotations

import argparse
import copy

import torchpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torchpar.init(cluster="local", num_devices=4)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.ViTConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, image_size=32, patch_size=8, num_labels=10)
    model = transformers.ViTForImageClassification(config)
    batch = {"pixel_values": torch.randn(16, 3, 32, 32), "labels": torch.randint(0, 10, (16,))}
    single_model = copy.deepcopy(model)
    data_parallel = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch,
                                     method=torchpar.DataParallel(mesh_shape=(1, 4)))
    one_device = torchpar.compile(single_model, torch.optim.AdamW(single_model.parameters(), lr=1e-3),
                                  example_batch=batch)
    print(data_parallel.plan.summary().splitlines()[0])
    print(f"{'step':>4}  {'4 devices':>10}  {'1 device':>10}")
    for step in range(args.steps):
        print(f"{step:>4}  {data_parallel.step(batch):>10.5f}  {one_device.step(batch):>10.5f}")


if __name__ == "__main__":
    main()
