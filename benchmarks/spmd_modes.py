"""One-stage plans as a per-device program (shard_map) vs under XLA's GSPMD partitioner.

    python benchmarks/spmd_modes.py [--devices 8] [--mesh 2x4] [--steps 6] [--warmup 2] [--json out.json]

For each model and method the same plan is compiled both ways (``torchpar.compile(..., spmd=...)``); the
table gives the collectives each compiled step contains (kinds, counts and bytes from the optimized HLO),
the final loss of both (they must agree), and the median step time of each, timed interleaved — one step
of each per round — so machine noise hits them alike. On fake CPU devices the devices share the host's
cores, so times say how much work the program does, not how a real cluster would scale.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

MODELS: dict[str, tuple[dict[str, Any], int, int]] = {
    # family -> (config overrides, batch size, sequence length)
    "gpt2": ({"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 128}, 16, 64),
    "llama": ({"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 8192}, 16, 64),
    "resnet": ({}, 16, 0),
}
METHODS = ("DataParallel", "Zero2Parallel", "Zero3Parallel", "MegatronParallel", "ShardParallel")
MODES = ("gspmd", "shard_map")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--mesh", default="2x4", help="logical mesh AxB (A·B ≤ --devices)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "spmd_modes.json"))
    args = parser.parse_args()

    import torchpar

    torchpar.init(num_devices=args.devices)
    import torch
    from tqdm import tqdm

    from torchpar.harness import zoo
    from torchpar.report.hlo import collectives

    mesh = tuple(int(x) for x in args.mesh.split("x"))
    rows = []
    cases = [(family, method) for family in args.models.split(",") for method in args.methods.split(",")]
    for family, method_name in tqdm(cases, desc="compile + time", file=sys.stderr):
        overrides, batch_size, seq_len = MODELS[family]
        torch.manual_seed(0)
        model, batch = zoo.build(family, overrides, batch_size=batch_size, seq_len=seq_len or 16)
        engines = {}
        for mode in MODES:
            replica = copy.deepcopy(model)
            method = getattr(torchpar, method_name)(mesh_shape=mesh)
            engines[mode] = torchpar.compile(replica, torch.optim.AdamW(replica.parameters(), lr=1e-3),
                                             example_batch=batch, method=method, spmd=mode)
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        losses: dict[str, float] = {}
        for step in range(args.warmup + args.steps):
            for mode, engine in engines.items():
                start = time.perf_counter()
                losses[mode] = engine.step(batch).item()
                if step >= args.warmup:
                    times[mode].append(time.perf_counter() - start)
        row: dict[str, Any] = {"model": family, "method": method_name, "mesh": list(mesh)}
        for mode, engine in engines.items():
            found = collectives(engine.hlo_text()[0])
            kinds = sorted({c.kind for c in found})
            row[mode] = {
                "ran_as": engine.spmd_mode,
                "collectives": {k: sum(1 for c in found if c.kind == k) for k in kinds},
                "collective_bytes": {k: sum(c.bytes for c in found if c.kind == k) for k in kinds},
                "median_step_s": statistics.median(times[mode]),
                "final_loss": losses[mode],
            }
        row["step_time_ratio_shard_map_over_gspmd"] = row["shard_map"]["median_step_s"] / row["gspmd"]["median_step_s"]
        rows.append(row)

    print(f"\n{'model':<7} {'method':<16} {'mode':<10} {'collectives (count, KiB)':<62} {'step ms':>8} {'loss':>9}")
    for row in rows:
        for mode in MODES:
            entry = row[mode]
            text = ", ".join(f"{k} {n}×/{entry['collective_bytes'][k] / 1024:.0f}" for k, n in entry["collectives"].items())
            print(f"{row['model']:<7} {row['method']:<16} {entry['ran_as']:<10} {text:<62} "
                  f"{entry['median_step_s'] * 1e3:8.1f} {entry['final_loss']:9.5f}")
        print(f"{'':<7} {'':<16} {'ratio':<10} {'shard_map / gspmd step time':<62} "
              f"{row['step_time_ratio_shard_map_over_gspmd']:8.2f}")
    result = {"machine": platform.platform(), "cpus": os.cpu_count(), "devices": args.devices, "steps": args.steps,
              "warmup": args.warmup, "rows": rows}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
