"""Train a small CNN classifier whose ``forward(x)`` returns logits, with the loss computed in a ``step_fn``, and
check it against PyTorch step by step (synthetic images, no downloads).

    python examples/classifier_step_fn.py [--steps 10] [--devices 4]

``step_fn(model, batch)`` is how torchpar calls a model that does not take the whole batch or return its loss
(torchvision-style classifiers): it unpacks the batch, calls the model and returns the scalar loss, exactly as the
training loop would. ``forward_fn`` does the same for ``engine.forward`` (evaluation). The metrics of each step
(samples/s, MFU, memory) are printed with ``log_every``.
"""

from __future__ import annotations

import argparse
import copy
import logging

import torchpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--devices", type=int, default=4, help="DataParallel over this many (fake CPU) devices")
    args = parser.parse_args()
    torchpar.init(cluster="local", num_devices=args.devices)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("torchpar.metrics").setLevel(logging.INFO)

    import torch
    import torch.nn.functional as F

    class SmallCNN(torch.nn.Module):
        def __init__(self, classes: int = 10):
            super().__init__()
            self.features = torch.nn.Sequential(
                torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.SiLU(),
                torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.SiLU(),
                torch.nn.Conv2d(32, 32, 3, stride=2, padding=1), torch.nn.SiLU())
            self.classifier = torch.nn.Linear(32 * 4 * 4, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # logits, as torchvision models return
            return self.classifier(self.features(x).flatten(1))

    def step_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def forward_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return model(batch[0])

    torch.manual_seed(0)
    model = SmallCNN()
    reference = copy.deepcopy(model)
    batch = (torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,)))
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch,
                              step_fn=step_fn, forward_fn=forward_fn, method=torchpar.DataParallel(),
                              log_every=max(args.steps // 2, 1))
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    print(f"{'step':>4}  {'torchpar':>10}  {'pytorch':>10}")
    for step in range(args.steps):
        ref_optimizer.zero_grad()
        ref_loss = step_fn(reference, batch)
        ref_loss.backward()
        ref_optimizer.step()
        print(f"{step:>4}  {engine.step(batch):>10.6f}  {ref_loss.item():>10.6f}")
    reference.eval()
    with torch.no_grad():
        gap = (engine.forward(batch) - reference(batch[0])).abs().max().item()
    print(f"eval logits: largest difference from PyTorch {gap:.2e}")
    print(f"last step: {engine.last_metrics.samples_per_s:.0f} samples/s, "
          f"{engine.last_metrics.model_flops_per_step / 1e6:.1f} MFLOP")
    engine.close()


if __name__ == "__main__":
    main()
