"""Pipeline speed-up on simulated hosts: a 2-stage pipeline on 2 Ray host actors with one core each vs
one host actor (one core) running the whole model.

    python benchmarks/pipeline.py [--width 1024] [--depth 8] [--batch 4096] [--micro-batches 8] [--steps 7]

Both engines train the same compute-bound MLP (tanh, MSE loss) with SGD; their steps are interleaved (one
of each per round) and the medians compared. Also reports the measured bubble fraction of the pipeline
next to the ideal (S−1)/(M+S−1), and where the pipeline's time beyond its ideal step
(one host's step · (M+S−1)/(M·S)) goes, per stage, from ``engine.last_timeline.breakdown()``: compute
beyond one host's share, per-instruction overhead (dispatch, input placement, sends, building received
arrays, the interpreter's Python), launch and tail of the step, and waiting for the neighbour beyond the
ideal bubble. Prints tables and writes JSON.
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
    parser.add_argument("--activation", choices=("tanh", "relu"), default="tanh")
    parser.add_argument("--json", default="benchmarks/results/pipeline.json")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    if cores < 2:
        print("needs at least 2 cores", file=sys.stderr)
        return 2
    import ray

    import torchpar

    # Ray starts its workers at nice 15: on a machine where anything else runs, the host actors then get a sliver
    # of a busy core, and the pipeline, which needs both cores, loses more than the one-host run. Normal priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False)  # 4 actors, at most 2 running at once
    import torch

    from torchpar.cluster import shutdown

    class DeepMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(args.width, args.width) for _ in range(args.depth))

        def forward(self, x, y):
            for index, layer in enumerate(self.layers):
                x = activation(layer(x))
                if index == args.depth // 2 - 1:
                    x = torchpar.mark_pipeline_boundary(x)
            return torch.nn.functional.mse_loss(x, y)

    activation = torch.tanh if args.activation == "tanh" else torch.relu
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
    single_compute: list[float] = []
    times = {"one host": [], "one host, micro-batched": [], "2-stage pipeline": []}
    bubbles = []
    breakdowns = []
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
                    breakdowns.append(eng.last_timeline.breakdown())
                if eng is single and round_index >= args.warmup:
                    single_compute.append(sum(b[3] - b[2] for b in eng.last_timeline.blocks[0]))
    medians = {name: statistics.median(values) for name, values in times.items()}
    speedup = medians["one host"] / medians["2-stage pipeline"]
    stages, micro = 2, args.micro_batches
    ideal_bubble = (stages - 1) / (micro + stages - 1)
    measured_bubble = statistics.median(bubbles)
    print(f"MLP {args.depth}×{args.width}, batch {args.batch}, {micro} micro-batches, 1 core per host")
    print(f"{'runner':<20}{'median step s':>15}")
    for name, value in medians.items():
        print(f"{name:<20}{value:>15.3f}")
    print(f"speed-up {speedup:.2f}× (ideal {micro * stages / (micro + stages - 1):.2f}×); bubble fraction measured "
          f"{measured_bubble:.3f}, ideal (S−1)/(M+S−1) = {ideal_bubble:.3f}")
    breakdown = [{key: statistics.median(b[stage][key] for b in breakdowns) for key in breakdowns[0][stage]}
                 for stage in range(stages)]
    beyond = _beyond_ideal(breakdown, medians["one host"], statistics.median(single_compute), stages, micro)
    _print_breakdown(breakdown, beyond, medians, stages, micro)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"config": vars(args), "median_step_s": medians, "all_step_s": times, "speedup": speedup,
                   "ideal_speedup": micro * stages / (micro + stages - 1),
                   "bubble_fraction_measured": measured_bubble, "bubble_fraction_ideal": ideal_bubble,
                   "all_bubble_fractions": bubbles, "breakdown_s": breakdown, "beyond_ideal_s": beyond,
                   "one_host_compute_s": statistics.median(single_compute)}, handle, indent=1)
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


OVERHEAD_KEYS = ("dispatch", "input", "send", "recv_copy", "interpreter")


def _beyond_ideal(breakdown: list[dict[str, float]], one_host_s: float, one_host_compute_s: float, stages: int,
                  micro: int) -> list[dict[str, float]]:
    """Per stage, the pipeline step's seconds beyond the ideal ``one_host_s · (M+S−1)/(M·S)``, split into
    compute beyond one host's share (``one_host_compute_s / S``), per-instruction overhead, launch + tail, and
    waiting beyond the ideal bubble (``one_host_compute_s / S · (S−1)/M``); the parts sum to the makespan minus
    the ideal step, up to one host's own launch and tail."""
    share = one_host_compute_s / stages
    result = []
    for parts in breakdown:
        result.append({"compute": parts["compute"] - share,
                       "overhead": sum(parts[k] for k in OVERHEAD_KEYS),
                       "launch+tail": parts["launch"] + parts["tail"] - (one_host_s - one_host_compute_s),
                       "wait": parts["recv_wait"] - share * (stages - 1) / micro})
    return result


def _print_breakdown(breakdown: list[dict[str, float]], beyond: list[dict[str, float]], medians: dict[str, float],
                     stages: int, micro: int) -> None:
    keys = list(breakdown[0])
    print("pipeline step by stage (ms, median over steps; parts sum to the step's wall time):")
    print(f"{'stage':<8}" + "".join(f"{k:>12}" for k in keys))
    for stage, parts in enumerate(breakdown):
        print(f"{stage:<8}" + "".join(f"{1e3 * parts[k]:>12.1f}" for k in keys))
    ideal = medians["one host"] * (micro + stages - 1) / (micro * stages)
    print(f"ideal pipeline step {1e3 * ideal:.1f} ms, measured {1e3 * medians['2-stage pipeline']:.1f} ms; "
          "beyond the ideal, by stage (ms):")
    print(f"{'stage':<8}" + "".join(f"{k:>13}" for k in beyond[0]) + f"{'per micro-batch overhead':>26}")
    for stage, parts in enumerate(beyond):
        print(f"{stage:<8}" + "".join(f"{1e3 * v:>13.1f}" for v in parts.values())
              + f"{1e3 * parts['overhead'] / micro:>26.2f}")


if __name__ == "__main__":
    sys.exit(main())
