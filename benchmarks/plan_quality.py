"""Plan quality: the automatic ShardParallel plan against the hand plans, by the cost model and in HLO.

    python benchmarks/plan_quality.py [--meshes 1x4,2x2,2x4,1x8] [--no-hlo] [--json out.json]

For each model and logical mesh it plans with ShardParallel (auto), DataParallel, Zero2Parallel,
Zero3Parallel and MegatronParallel, and reports each plan's estimated step cost and communication
(the ILP's alpha-beta model) and — unless --no-hlo — the bytes of every collective in the HLO XLA
compiles for it. The auto plan must never cost more than the best hand plan by the cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torchpar

MODELS = {
    # name: (zoo family, overrides, batch size, sequence length)
    "mlp-wide": ("mlp", {"width": 256, "depth": 6}, 32, 0),
    "mlp-narrow": ("mlp", {"width": 32, "depth": 6}, 256, 0),
    "gpt2": ("gpt2", {"n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 1024}, 8, 32),
    "llama": ("llama", {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
                        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024}, 8, 32),
    "moe": ("moe", {"width": 128, "hidden": 256, "experts": 8}, 8, 32),
}
KINDS = {
    "auto": torchpar.ShardParallel,
    "dp": torchpar.DataParallel,
    "zero2": torchpar.Zero2Parallel,
    "zero3": torchpar.Zero3Parallel,
    "megatron": torchpar.MegatronParallel,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--meshes", default="1x4,2x2,2x4,1x8")
    parser.add_argument("--no-hlo", action="store_true", help="cost model only (skip XLA compilation)")
    parser.add_argument("--json", default="benchmarks/results/plan_quality.json")
    args = parser.parse_args(argv)
    meshes = [tuple(int(d) for d in m.split("x")) for m in args.meshes.split(",")]
    torchpar.init(cluster="local", num_devices=max(a * b for a, b in meshes))
    import torch
    import transformers

    from torchpar.harness import zoo
    from torchpar.report.hlo import collectives

    transformers.logging.set_verbosity_error()
    rows, violations = [], 0
    print(f"{'model':<11}{'mesh':<6}" + "".join(f"{k + ' est ms':>16}" for k in KINDS)
          + ("" if args.no_hlo else "".join(f"{k + ' HLO KiB':>15}" for k in KINDS)) + "  auto≤best")
    for name in args.models.split(","):
        family, overrides, batch_size, seq_len = MODELS[name]
        for mesh in meshes:
            torch.manual_seed(0)
            model, batch = zoo.build(family, overrides, batch_size=batch_size, seq_len=max(seq_len, 1))
            row = {"model": name, "mesh": list(mesh), "plans": {}}
            for kind, method_cls in KINDS.items():
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
                start = time.perf_counter()
                plan = torchpar.plan(model, optimizer, example_batch=batch, method=method_cls(mesh_shape=mesh))
                stage = plan.stages[0]
                entry = {"estimated_s": stage.estimated_cost_s, "communication_s": stage.estimated_communication_s,
                         "memory_bytes": stage.estimated_memory_bytes, "plan_s": time.perf_counter() - start}
                if not args.no_hlo:
                    engine = torchpar.compile(model, optimizer, example_batch=batch, method=plan)
                    found = collectives(engine.hlo_text()[0])
                    entry["hlo_collective_bytes"] = sum(c.bytes for c in found)
                    entry["hlo_collectives"] = {k: sum(1 for c in found if c.kind == k) for k in {c.kind for c in found}}
                row["plans"][kind] = entry
            best_hand = min(row["plans"][k]["estimated_s"] for k in KINDS if k != "auto")
            ok = row["plans"]["auto"]["estimated_s"] <= best_hand * (1 + 1e-6)
            violations += not ok
            row["auto_not_worse"] = ok
            rows.append(row)
            line = f"{name:<11}{f'{mesh[0]}x{mesh[1]}':<6}" + "".join(
                f"{row['plans'][k]['estimated_s'] * 1e3:16.3f}" for k in KINDS)
            if not args.no_hlo:
                line += "".join(f"{row['plans'][k]['hlo_collective_bytes'] / 1024:15.1f}" for k in KINDS)
            print(line + ("  yes" if ok else "  NO"), flush=True)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"cluster": "local fake CPU devices, default ClusterSpec alpha/beta", "rows": rows}, handle, indent=1)
    print(f"wrote {args.json}; auto plan worse than a hand plan in {violations} case(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
