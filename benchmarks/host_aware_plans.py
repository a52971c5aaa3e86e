"""Host-aware plans: what PipeshardParallel and ShardParallel choose as the network between hosts slows down.

    python benchmarks/host_aware_plans.py [--json benchmarks/results/host_aware_plans.json]

For each model (GPT-2 of the README's CLI line: 12 layers of 64; GPT-2 124M: 12 layers of 768) it plans on
2 hosts × 4 devices under several clusters: in-host links like NVLink (α 10 µs, 400 GB/s) and a network 1×, 3×,
10× and 100× slower, then the hardware presets. It prints, per cluster, the stages (layers on submesh /
logical mesh), whether any chosen mesh axis crosses hosts, and the estimated step, and the same for the
one-stage ShardParallel plan over all 8 devices (which must cross hosts on some axis: the question is which).
No compilation and no step: planning only, so the figures are the cost model's, not measurements.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torchpar

FAST_ALPHA, FAST_BETA = 1e-5, 1 / 400e9
MODELS = {
    # name: (GPT2Config overrides, micro-batch size, sequence length)
    "gpt2-12x64": ({"n_layer": 12, "n_embd": 64, "n_head": 4, "vocab_size": 128}, 2, 128),
    "gpt2-124M": ({"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50304, "n_positions": 1024}, 8, 1024),
}


def clusters(base) -> dict[str, object]:
    nvlink = replace(base, alpha=(FAST_ALPHA,) * 2, beta=(FAST_BETA,) * 2, device_flops=312e12,
                     device_memory_bytes=80 << 30, preset=None)
    result = {f"network {slow}x slower": replace(nvlink, inter_host_alpha=3 * FAST_ALPHA,
                                                  inter_host_beta=slow * FAST_BETA) for slow in (1, 3, 10, 100)}
    result["defaults (cpu-sim)"] = base
    for name in ("h100-sxm", "a100-sxm", "v100-p3"):
        result[name] = base.from_preset(name, num_hosts=base.num_hosts, devices_per_host=base.devices_per_host)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/host_aware_plans.json")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    base = torchpar.init(cluster="local", num_hosts=2, devices_per_host=4)
    import torch
    import transformers

    from torchpar.capture.export import capture_train_step
    from torchpar.planner.for_method import plan_for_method
    from torchpar.planner.pipeline.pipeline_plan import plan_pipeline

    transformers.logging.set_verbosity_error()
    rows = []
    print(f"{'model':<12}{'cluster':<22}{'method':<10}{'est. step':>11}  {'crosses hosts':<14}stages")
    for name in args.models.split(","):
        overrides, micro_batch, seq_len = MODELS[name]
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{"n_positions": seq_len, **overrides}))
        params = {n for n, _ in model.named_parameters()}
        ids = torch.randint(0, overrides["vocab_size"], (micro_batch, seq_len))
        micro_graph = capture_train_step(model, {"input_ids": ids, "labels": ids}).graph
        full = torch.randint(0, overrides["vocab_size"], (4 * micro_batch, seq_len))
        full_graph = capture_train_step(model, {"input_ids": full, "labels": full}).graph
        method = torchpar.PipeshardParallel(num_micro_batches=4, layer_option=torchpar.AutoLayerOption(layer_num=4))
        for label, cluster in clusters(base).items():
            planners = {
                "pipeshard": lambda: plan_pipeline(micro_graph, method, cluster, trainable=params,
                                                   optimizer_state_copies=2).plan,
                "shard": lambda: plan_for_method(full_graph, torchpar.ShardParallel(), cluster, trainable=params,
                                                 optimizer_state_copies=2)}
            for kind, make_plan in planners.items():
                start = time.perf_counter()
                try:
                    plan = make_plan()
                except ValueError as error:  # e.g. nothing fits the preset's memory
                    reason = str(error).splitlines()[-1].strip()
                    print(f"{name:<12}{label:<22}{kind:<10}{'—':>11}  {'—':<14}no plan: {reason[:90]}")
                    rows.append({"model": name, "cluster": label, "method": kind, "error": str(error)})
                    continue
                crossing = any(any(s.crosses_hosts) for s in plan.stages)
                stages = " | ".join(f"L{s.layers[0]}-{s.layers[-1]} {s.submesh_shape[0]}x{s.submesh_shape[1]}/"
                                    f"{s.logical_mesh_shape[0]}x{s.logical_mesh_shape[1]}"
                                    + ("*" if any(s.crosses_hosts) else "") for s in plan.stages)
                print(f"{name:<12}{label:<22}{kind:<10}{plan.estimated_step_s * 1e3:>9.3f}ms  {str(crossing):<14}"
                      f"{stages}")
                rows.append({"model": name, "cluster": label, "method": kind, "estimated_step_s": plan.estimated_step_s,
                             "crosses_hosts": crossing, "stages": [
                                 {"layers": s.layers, "submesh_shape": list(s.submesh_shape),
                                  "logical_mesh_shape": list(s.logical_mesh_shape),
                                  "crosses_hosts": s.crosses_hosts} for s in plan.stages],
                             "plan_s": time.perf_counter() - start})
    print("* a stage with a mesh axis that crosses hosts")
    with open(args.json, "w", encoding="utf-8") as out:
        json.dump({"rows": rows, "in_host": {"alpha": FAST_ALPHA, "beta": FAST_BETA}}, out, indent=1)
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
