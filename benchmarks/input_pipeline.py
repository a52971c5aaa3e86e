"""The input pipeline: what each host receives per step, and whether prefetching hides a slow collate.

    python benchmarks/input_pipeline.py [--steps 20] [--collate-ms 20] [--part all|prefetch|bytes]

**prefetch** (one process, one device): an MLP step of about the collate's duration, fed by a ``DataLoader``
whose ``collate_fn`` sleeps ``--collate-ms``. Three loops, medians of the per-step wall time: the step alone
(batches collated beforehand), ``for b in loader: engine.step(b)`` (collate then step: their sum), and
``for b in engine.prefetch(loader): engine.step(b)`` (the next batch collated and placed on a background thread
while the step runs: their maximum, ideally). ``engine.last_metrics.data_wait_s`` is reported beside.

**bytes** (2 simulated Ray hosts × 2 devices, DataParallel): an image batch (``--images`` × 3 × 64 × 64 fp32 and
int64 labels) fed by the driver; the bytes each host actor received for the step's batch, as the worker counted
them (``engine.executor.last_input_bytes``), against the batch's bytes. Before torchpar sent only each host's
rows, every host received the whole batch (100%). Host-loaded data (``torchpar.HostData``) on the same cluster
sends none.

Prints tables and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _median_step_s(run_steps) -> float:
    times = []
    for _ in run_steps():
        times.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def prefetch_part(args: argparse.Namespace) -> dict:
    import torchpar

    torchpar.init(cluster="local", num_devices=1)
    import torch

    width = args.width
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                  for _ in range(4)])
    data = torch.utils.data.TensorDataset(torch.randn(args.batch * (args.steps + 2), width),
                                          torch.randn(args.batch * (args.steps + 2), width))

    def slow_collate(samples):
        time.sleep(args.collate_ms / 1000)
        return torch.utils.data.default_collate(samples)

    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, collate_fn=slow_collate)
    step_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=1e-3), example_batch=next(iter(loader)),
                              step_fn=step_fn)
    collated = [torch.utils.data.default_collate([data[i] for i in range(k * args.batch, (k + 1) * args.batch)])
                for k in range(args.steps + 1)]
    engine.step(collated[0])  # compile

    def alone():
        for batch in collated:
            engine.step(batch)
            yield

    def plain():
        for batch in loader:
            engine.step(batch)
            yield

    waits = []

    def prefetched():
        for batch in engine.prefetch(loader):
            engine.step(batch)
            waits.append(engine.last_metrics.data_wait_s)
            yield

    step_s, plain_s, prefetch_s = _median_step_s(alone), _median_step_s(plain), _median_step_s(prefetched)
    collate_s = args.collate_ms / 1000
    engine.close()
    row = {"step_alone_ms": step_s * 1e3, "collate_ms": args.collate_ms, "plain_loop_ms": plain_s * 1e3,
           "prefetch_loop_ms": prefetch_s * 1e3, "sum_ms": (step_s + collate_s) * 1e3,
           "max_ms": max(step_s, collate_s) * 1e3, "prefetch_data_wait_ms": statistics.median(waits[1:]) * 1e3}
    print("\nprefetch (one process, 1 device): median wall ms per step")
    print(f"{'step alone':>12} {'collate':>8} {'plain loop':>11} {'prefetched':>11} {'step+collate':>13} "
          f"{'max(step,collate)':>18} {'data wait (prefetched)':>23}")
    print(f"{row['step_alone_ms']:12.1f} {row['collate_ms']:8.1f} {row['plain_loop_ms']:11.1f} "
          f"{row['prefetch_loop_ms']:11.1f} {row['sum_ms']:13.1f} {row['max_ms']:18.1f} "
          f"{row['prefetch_data_wait_ms']:23.1f}")
    return row


def bytes_part(args: argparse.Namespace) -> dict:
    import torchpar

    torchpar.init(cluster="ray", num_hosts=2, devices_per_host=2)
    import torch

    images = torch.randn(args.images, 3, 64, 64)
    labels = torch.randint(0, 10, (args.images,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 16 * 16, 10))
    step_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    rows = []
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=1e-2), example_batch=(images, labels),
                          step_fn=step_fn, method=torchpar.DataParallel()) as engine:
        for _ in range(2):
            engine.step((images, labels))
        batch_bytes = images.numel() * 4 + labels.numel() * 4  # labels travel as int32 (JAX without x64)
        for rank, received in enumerate(engine.executor.last_input_bytes):
            rows.append({"form": "driver-fed", "host": rank, "received_bytes": received, "batch_bytes": batch_bytes,
                         "share": received / batch_bytes})
    dataset = torch.utils.data.TensorDataset(images, labels)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=1e-2),
                          data=torchpar.HostData(dataset, batch_size=args.images, shuffle=False),
                          step_fn=step_fn, method=torchpar.DataParallel()) as engine:
        for _ in range(2):
            engine.step()
        for rank, received in enumerate(engine.executor.last_input_bytes):
            rows.append({"form": "host-loaded", "host": rank, "received_bytes": received, "batch_bytes": batch_bytes,
                         "share": received / batch_bytes})
    torchpar.shutdown()
    print("\nbytes each host actor received per step (2 hosts × 2 devices, DataParallel)")
    print(f"{'form':>12} {'host':>5} {'received':>12} {'batch':>12} {'share':>7}")
    for row in rows:
        print(f"{row['form']:>12} {row['host']:5d} {row['received_bytes']:12,d} {row['batch_bytes']:12,d} "
              f"{row['share']:7.1%}")
    return {"hosts": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "prefetch", "bytes"], default="all")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--collate-ms", type=float, default=20.0)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--json", default="benchmarks/results/input_pipeline.json")
    args = parser.parse_args(argv)
    result: dict = {"machine": {"cpus": os.cpu_count(), "platform": sys.platform}}
    if args.part in ("all", "prefetch"):
        result["prefetch"] = prefetch_part(args)
    if args.part in ("all", "bytes"):
        result["bytes"] = bytes_part(args)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
