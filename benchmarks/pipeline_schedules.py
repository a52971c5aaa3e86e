"""Pipeline schedules compared: 1F1B, interleaved 1F1B and ZB-H1 on 4 stages × 8 micro-batches.

    python benchmarks/pipeline_schedules.py [--width 1024] [--batch 1024] [--steps 5]

The local runtime on 4 fake CPU devices (one device per device group) trains a compute-bound 8-layer MLP
(tanh, MSE) with SGD under each schedule: 1F1B, GPipe and ZB-H1 with 4 stages of 2 layers; interleaved 1F1B
with 8 stages of 1 layer, 2 per device group (stage s on device s mod 4). Per schedule it reports

- the simulated bubble on equal stages (forward = input-gradient = weight-gradient time:
  :mod:`torchpar.planner.pipeline.schedules`'s formulas), and simulated again with the op times measured in the run;
- the measured bubble (``engine.last_timeline.bubble_fraction``) and step time (medians over the steps);

and, on one stage, what the split backward (ZB-H1's B then W, :mod:`torchpar.runtime.pipeline.split_backward`) costs
against the fused backward. Prints tables and writes JSON. The measured figures need a core per device: on
fewer cores the stages time-share them, which stretches blocks that overlap and hides idle time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1")
GROUPS, MICRO_BATCHES, DEPTH = 4, 8, 8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--split-reps", type=int, default=20)
    parser.add_argument("--json", default="benchmarks/results/pipeline_schedules.json")
    args = parser.parse_args(argv)

    import torchpar

    torchpar.init(cluster="local", num_devices=GROUPS)
    import torch

    from torchpar.planner.pipeline.schedules import make_schedule, simulate

    class DeepMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(args.width, args.width) for _ in range(DEPTH))

        def forward(self, x, y):
            for index, layer in enumerate(self.layers):
                x = torch.tanh(layer(x))
                if index < DEPTH - 1:
                    x = torchpar.mark_pipeline_boundary(x)
            return torch.nn.functional.mse_loss(x, y)

    torch.manual_seed(0)
    batch = (torch.randn(args.batch, args.width), torch.randn(args.batch, args.width))
    engines = {}
    for schedule in SCHEDULES:
        virtual = 2 if schedule == "interleaved_1f1b" else 1
        stages = GROUPS * virtual
        per = DEPTH // stages
        option = torchpar.ManualStageOption(forward_stage_layer_ids=tuple(tuple(range(s * per, (s + 1) * per))
                                                                          for s in range(stages)),
                                            submesh_physical_shapes=((1, 1),) * stages,
                                            submesh_logical_shapes=((1, 1),) * stages)
        torch.manual_seed(0)
        model = DeepMLP()
        method = torchpar.PipeshardParallel(num_micro_batches=MICRO_BATCHES, layer_option="manual",
                                            stage_option=option, schedule=schedule)
        engines[schedule] = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                             example_batch=batch, method=method)
    times = {name: [] for name in SCHEDULES}
    bubbles = {name: [] for name in SCHEDULES}
    durations: dict[str, dict[str, list[float]]] = {name: {} for name in SCHEDULES}
    try:
        for round_ in range(args.warmup + args.steps):  # one step of each per round: the machine's load hits all alike
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.step(batch)
                elapsed = time.perf_counter() - start
                if round_ < args.warmup:
                    continue
                times[name].append(elapsed)
                timeline = engine.last_timeline
                bubbles[name].append(timeline.bubble_fraction)
                for row in timeline.blocks:
                    for op, _, begin, end in row:
                        durations[name].setdefault(op, []).append(end - begin)
        split_cost = _split_cost(engines["zb_h1"], args.split_reps)
    finally:
        for engine in engines.values():
            engine.shutdown()
    rows = []
    for schedule in SCHEDULES:
        virtual = 2 if schedule == "interleaved_1f1b" else 1
        stages = GROUPS * virtual
        lists = make_schedule(schedule, stages, MICRO_BATCHES, virtual_stages=virtual)
        # equal stages: each stage's micro-batch costs f + b = 3 units, f = b_in = w = 1 (a v-th per chunk)
        equal = simulate(lists, 1.0 / virtual, 2.0 / virtual, weight_time=1.0 / virtual)
        med = {op: statistics.median(d) for op, d in durations[schedule].items()}
        if schedule == "zb_h1":
            measured_sim = simulate(lists, med["forward"], med["backward_input"] + med["backward_weight"],
                                    weight_time=med["backward_weight"])
        else:
            measured_sim = simulate(lists, med["forward"], med["backward"])
        rows.append({"schedule": schedule, "stages": stages, "device_groups": GROUPS,
                     "micro_batches": MICRO_BATCHES, "simulated_bubble_equal": equal.bubble_fraction,
                     "simulated_bubble_measured_ops": measured_sim.bubble_fraction,
                     "simulated_step_measured_ops_s": measured_sim.makespan,
                     "measured_bubble": statistics.median(bubbles[schedule]), "measured_bubbles": bubbles[schedule],
                     "step_s": statistics.median(times[schedule]), "step_times_s": times[schedule],
                     "median_op_s": med})

    print(f"\n{GROUPS} device groups × {MICRO_BATCHES} micro-batches, MLP {DEPTH}×{args.width}, batch {args.batch}, "
          f"local runtime on {GROUPS} fake CPU devices, {os.cpu_count()} cores")
    header = (f"{'schedule':<18}{'stages':>7}{'sim. bubble':>13}{'sim. (meas. ops)':>18}{'meas. bubble':>14}"
              f"{'step s':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['schedule']:<18}{r['stages']:>7}{r['simulated_bubble_equal']:>13.1%}"
              f"{r['simulated_bubble_measured_ops']:>18.1%}{r['measured_bubble']:>14.1%}{r['step_s']:>9.3f}")
    if split_cost:
        print(f"\nsplit backward on stage {split_cost['stage']} (median of {args.split_reps}): fused "
              f"{split_cost['fused_s'] * 1e3:.2f} ms, B {split_cost['input_s'] * 1e3:.2f} ms + W "
              f"{split_cost['weight_s'] * 1e3:.2f} ms = {split_cost['split_s'] * 1e3:.2f} ms "
              f"({split_cost['split_s'] / split_cost['fused_s']:.2f}× fused); equations B/W "
              f"{split_cost['equations']}, carry {split_cost['carry_bytes']} bytes")
    result = {"config": {"width": args.width, "batch": args.batch, "depth": DEPTH, "groups": GROUPS,
                         "micro_batches": MICRO_BATCHES, "steps": args.steps, "cores": os.cpu_count()},
              "schedules": rows, "split_backward": split_cost}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    return 0


def _split_cost(engine, reps: int) -> dict:
    """Fused backward vs backward_input + backward_weight on the ZB-H1 engine's stage 1 (single-threaded,
    on one micro-batch of zeros)."""
    import jax
    import numpy as np

    from jaxbackend.dtypes import to_jax

    worker = engine._executor.worker  # the local runtime's one worker
    stage = 1
    program, state = worker.programs[stage], worker.states[stage]
    graph_inputs = program.stage.graph.inputs
    zeros = lambda meta: np.zeros(meta.shape, to_jax(meta.dtype))  # noqa: E731
    acts = {i.name: program.put_activation(i.name, zeros(i.meta)) for i in graph_inputs if i.kind == "activation"}
    inputs = {int(i.target): program.put_input(int(i.target), zeros(i.meta)) for i in graph_inputs
              if i.kind == "input"}
    diff, _, _, vjp = program.forward(state.params, state.buffers, inputs, acts, jax.random.key(0))
    cotangents = {n: jax.numpy.ones_like(v) for n, v in diff.items() if n != "__loss__"}

    def timed(fn):
        fn()
        samples = []
        for _ in range(reps):
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
        return statistics.median(samples)

    fused = timed(lambda: jax.block_until_ready(program.backward(vjp, cotangents)))
    _, carry = program.backward_input(vjp, cotangents)
    input_s = timed(lambda: jax.block_until_ready(program.backward_input(vjp, cotangents)))
    weight_s = timed(lambda: jax.block_until_ready(program.backward_weight_into(vjp, cotangents, carry, None)))
    return {"stage": stage, "fused_s": fused, "input_s": input_s, "weight_s": weight_s, "split_s": input_s + weight_s,
            **program.split_stats()}


if __name__ == "__main__":
    sys.exit(main())
