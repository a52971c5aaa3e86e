"""How the sharding ILP's size and solve time grow with model depth.

    python benchmarks/solver_scaling.py [--layers 1,2,4,8,12,24] [--mesh 2x4]

GPT-2 (d=768, 12 heads, vocab 50257, batch 8×512) with n_layer layers, planned by ShardParallel on
one logical mesh, with identical transformer blocks sharing one strategy choice (the default) and
without sharing. Then, with ``--full-plan N`` (default 12), the whole ``ShardParallel()`` planning of the
N-layer model (GPT-2 124 M at 12) for the mesh's device count: every logical mesh shape, one ILP each.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="1,2,4,8,12,24")
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--full-plan", type=int, default=12, help="layers of the fully planned model (0: skip)")
    parser.add_argument("--json", default="benchmarks/results/solver_scaling.json")
    args = parser.parse_args(argv)
    import torchpar

    mesh_shape = tuple(int(d) for d in args.mesh.split("x"))
    torchpar.init(num_devices=mesh_shape[0] * mesh_shape[1])
    import torch
    import transformers

    from torchpar.capture.export import capture_train_step
    from torchpar.cluster import ClusterSpec
    from torchpar.harness import zoo
    from torchpar.planner.intra_op import logical_mesh
    from torchpar.planner.sharding.ilp import solve
    from torchpar.planner.sharding.solver_graph import build_solver_graph

    transformers.logging.set_verbosity_error()
    mesh = logical_mesh(mesh_shape, ClusterSpec(num_hosts=1, devices_per_host=mesh_shape[0] * mesh_shape[1]))
    rows = []
    print(f"{'layers':>6}{'ops':>7}{'roots':>7}{'strategies':>11}{'capture s':>10}{'graph s':>9}"
          f"{'vars':>8}{'solve s':>9}{'vars (no share)':>16}{'solve s (no share)':>19}")
    for layers in [int(n) for n in args.layers.split(",")]:
        torch.manual_seed(0)
        model, batch = zoo.build("gpt2", {"n_layer": layers, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
                                          "n_positions": 1024}, batch_size=8, seq_len=512)
        start = time.perf_counter()
        graph = capture_train_step(model, batch).graph
        capture_s = time.perf_counter() - start
        trainable = {n for n, _ in model.named_parameters()}
        start = time.perf_counter()
        solver_graph = build_solver_graph(graph, mesh, trainable=trainable, optimizer_state_copies=2)
        graph_s = time.perf_counter() - start
        shared = solve(solver_graph)
        for root in solver_graph.roots:
            root.share_key = None
        unshared = solve(solver_graph)
        row = {"layers": layers, "ops": len(graph.nodes), "roots": len(solver_graph.roots),
               "strategies": solver_graph.num_strategies, "capture_s": capture_s, "graph_s": graph_s,
               "shared": shared.stats(), "unshared": unshared.stats()}
        rows.append(row)
        print(f"{layers:>6}{row['ops']:>7}{row['roots']:>7}{row['strategies']:>11}{capture_s:>10.2f}{graph_s:>9.2f}"
              f"{shared.num_variables:>8}{shared.solve_s:>9.2f}{unshared.num_variables:>16}{unshared.solve_s:>19.2f}",
              flush=True)
    full_plan = _full_plan(args.full_plan, mesh_shape[0] * mesh_shape[1]) if args.full_plan else None
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"mesh": list(mesh_shape), "rows": rows, "full_plan": full_plan}, handle, indent=1)
    print(f"wrote {args.json}")
    return 0


def _full_plan(layers: int, devices: int) -> dict:
    """Seconds ``torchpar.plan(..., method=ShardParallel())`` spends capturing and planning the model."""
    import torch

    import torchpar
    from torchpar.harness import zoo

    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", {"n_layer": layers, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
                                      "n_positions": 1024}, batch_size=8, seq_len=512)
    start = time.perf_counter()
    plan = torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch,
                         method=torchpar.ShardParallel())
    total_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    result = {"layers": layers, "params": params, "devices": devices, "total_s": total_s, "timings": plan.timings,
              "mesh": list(plan.stages[0].logical_mesh_shape)}
    print(f"ShardParallel() plan of GPT-2 {layers} layers ({params / 1e6:.0f} M params) for {devices} devices: "
          f"capture {plan.timings['capture']:.1f} s, ILP over every mesh shape {plan.timings['ilp']:.1f} s "
          f"(chose {plan.stages[0].logical_mesh_shape})")
    return result


if __name__ == "__main__":
    sys.exit(main())
