"""Train a classifier from a ``Dataset`` on 2 simulated Ray hosts, each host loading its own rows.

    python examples/ray_host_data.py [--epochs 2] [--hosts 2] [--devices-per-host 2]

``torchpar.HostData`` hands the dataset to every host actor; the driver walks the sampler (the order a
``DataLoader(shuffle=True, generator=torch.Generator().manual_seed(seed))`` gives one process) and sends each host
only the dataset indices of the rows its devices hold: no batch bytes leave the driver. Each host collates its rows
itself, two steps ahead of the one running. ``engine.run(epochs=...)`` yields the losses; the last batch of an epoch
is kept (``drop_last=False``: it compiles once more).
"""

from __future__ import annotations

import argparse

import torchpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--devices-per-host", type=int, default=2)
    args = parser.parse_args()
    torchpar.init(cluster="ray", num_hosts=args.hosts, devices_per_host=args.devices_per_host)

    import torch
    import torch.nn.functional as F

    class Blobs(torch.utils.data.Dataset):
        """Points around 4 centres (a stand-in for files a host would open lazily)."""

        def __init__(self, n: int):
            generator = torch.Generator().manual_seed(0)
            self.labels = torch.randint(0, 4, (n,), generator=generator)
            centres = torch.randn(4, 32, generator=generator) * 3
            self.points = centres[self.labels] + torch.randn(n, 32, generator=generator)

        def __len__(self) -> int:
            return len(self.points)

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.points[index], self.labels[index]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torchpar.HostData(Blobs(600), batch_size=64, shuffle=True, seed=0)
    with torchpar.compile(model, optimizer, data=data, method=torchpar.DataParallel(),
                          step_fn=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1])) as engine:
        for step, loss in enumerate(engine.run(epochs=args.epochs)):
            metrics = engine.last_metrics
            print(f"step {step:2d}  loss {loss:.4f}  batch bytes from the driver per host "
                  f"{engine.executor.last_input_bytes}  waited {metrics.data_wait_s * 1e3:.1f} ms for data")
    torchpar.shutdown()


if __name__ == "__main__":
    main()
