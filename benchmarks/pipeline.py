"""Pipeline speed-up on simulated hosts: a 2-stage pipeline on 2 Ray host actors with one core each vs
one host actor (one core) running the whole model.

    python benchmarks/pipeline.py [--width 1024] [--depth 8] [--batch 4096] [--micro-batches 8] [--steps 7]

Both engines train the same compute-bound MLP with SGD; their steps are interleaved (one of each per
round) and the medians compared. Also reports the measured bubble fraction of the pipeline next to the
ideal (S−1)/(M+S−1). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default="benchmarks/results/pipeline.json")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    if cores < 2:
        print("needs at least 2 cores", file=sys.stderr)
        return 2
    import ray

    import torchpar

    ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False)  # 4 actors, at most 2 running at once
    import torch

    from torchpar.cluster import shutdown

    class DeepMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(args.width, args.width) for _ in range(args.depth))

        def forward(self, x, y):
            for index, layer in enumerate(self.layers):
                x = torch.relu(layer(x))
                if index == args.depth // 2 - 1:
                    x = torchpar.mark_pipeline_boundary(x)
            return torch.nn.functional.mse_loss(x, y)

    torch.manual_seed(0)
    batch = (torch.randn(args.batch, args.width), torch.randn(args.batch, args.width))

    def engine(hosts: int, stages: int, micro: int):
        torchpar.init(cluster="ray", num_hosts=hosts, devices_per_host=1, cores_per_host=1)
        torch.manual_seed(0)
        model = DeepMLP()
        layer_ids = ((0, 1),) if stages == 1 else ((0,), (1,))
        option = torchpar.ManualStageOption(forward_stage_layer_ids=layer_ids,
                                            submesh_physical_shapes=((1, 1),) * stages,
                                            submesh_logical_shapes=((1, 1),) * stages)
        method = torchpar.PipeshardParallel(num_micro_batches=micro, layer_option="manual", stage_option=option)
        return torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=1e-3), example_batch=batch, method=method)

    single = engine(1, 1, 1)
    single_micro = engine(1, 1, args.micro_batches)
    piped = engine(2, 2, args.micro_batches)
    times = {"one host": [], "one host, micro-batched": [], "2-stage pipeline": []}
    bubbles = []
    for round_index in range(args.warmup + args.steps):
        for name, eng in (("one host", single), ("one host, micro-batched", single_micro),
                          ("2-stage pipeline", piped)):
            start = time.perf_counter()
            eng.step(batch)
            elapsed = time.perf_counter() - start
            if round_index >= args.warmup:
                times[name].append(elapsed)
                if eng is piped:
                    bubbles.append(eng.last_timeline.bubble_fraction)
    medians = {name: statistics.median(values) for name, values in times.items()}
    speedup = medians["one host"] / medians["2-stage pipeline"]
    stages, micro = 2, args.micro_batches
    ideal_bubble = (stages - 1) / (micro + stages - 1)
    measured_bubble = statistics.median(bubbles)
    print(f"MLP {args.depth}×{args.width}, batch {args.batch}, {micro} micro-batches, 1 core per host")
    print(f"{'runner':<20}{'median step s':>15}")
    for name, value in medians.items():
        print(f"{name:<20}{value:>15.3f}")
    print(f"speed-up {speedup:.2f}× (bar ≥ 1.5×); bubble fraction measured {measured_bubble:.3f}, "
          f"ideal (S−1)/(M+S−1) = {ideal_bubble:.3f}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"config": vars(args), "median_step_s": medians, "all_step_s": times, "speedup": speedup,
                   "bubble_fraction_measured": measured_bubble, "bubble_fraction_ideal": ideal_bubble}, handle,
                  indent=1)
    timeline = piped.last_timeline
    for stage, blocks in enumerate(timeline.blocks):
        busy = sum(end - start for _, _, start, end in blocks)
        print(f"stage {stage}: busy {busy:.3f}s of makespan {timeline.makespan:.3f}s; blocks "
              + " ".join(f"{op[0].upper()}{mb}:{start:.2f}-{end:.2f}" for op, mb, start, end in blocks))
    print(f"wrote {args.json}")
    single.shutdown()
    single_micro.shutdown()
    piped.shutdown()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
