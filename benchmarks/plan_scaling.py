"""Planning time against cluster size and model size: GPT-3 1.3B / 13B / 39B / 175B on 64 to 1,024 GPUs, and
Mixtral-8×7B.

    python benchmarks/plan_scaling.py [--models 1.3b,13b,39b,175b,mixtral] [--devices 64,128,512,1024] [--timeout 900]

Each case plans a GPT-3-shaped ``GPT2LMHeadModel`` (or ``MixtralForCausalLM`` with Mixtral-8×7B's shapes, batch
1,024 × 2,048 in 128 micro-batches) built on the meta device (no weights) with ``torchpar.plan``:
``PipeshardParallel`` (16 layers by operator clustering, 1F1B), ``mixed_precision="bf16"``, ``remat="auto"``, on
``devices / 8`` hosts × 8 ``a100-80g`` GPUs — the way a new user would. Every case runs in its own process (no cache
carries over) under ``--timeout`` seconds. The table gives the total seconds (capture included) and the phases of
``plan.timings``: capture, the stage DP (its table of stage costs, and its search), the ILP refinement (solver graph
building, CP-SAT), and ``remat="auto"``'s planning of every option; then the plan (stages, remat, estimated step,
the least memory headroom per device) and the measured growth (×2 devices → ×t). Writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

MODELS = {  # layers, hidden, heads, sequence, global batch, micro-batches (GPT-3 paper / Alpa's table shapes)
    "1.3b": (24, 2048, 16, 1024, 1024, 64),
    "13b": (40, 5120, 40, 1024, 1024, 64),
    "39b": (48, 8192, 64, 1024, 1024, 64),
    "175b": (96, 12288, 96, 2048, 1536, 192),
}
MIXTRAL = {  # Mixtral-8×7B (46.7B) and a GShard MoE: layers, hidden, heads, KV heads, expert hidden, experts,
    #          top-k, vocab
    "mixtral": (32, 4096, 32, 8, 14336, 8, 2, 32000),
    "gshard-70b": (32, 2048, 32, 32, 5504, 64, 2, 32000),  # Alpa's largest MoE shape (examples/plan_moe.py)
}
MIXTRAL_BATCH = (2048, 1024, 128)  # sequence, global batch, micro-batches (2M tokens per step)
LLAMA = {  # Llama-3 70B: layers, hidden, heads, KV heads, MLP hidden, vocab, sequence, global batch, micro-batches
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 8192, 256, 1),  # torchtitan's: 2M tokens per step, 8 rows per
}                                                                    # data-parallel rank of 32, no accumulation


def build(model: str) -> tuple:
    """``(meta model, example batch, micro-batches)`` of one case."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if model in LLAMA:
        layers, hidden, heads, kv_heads, mlp_hidden, vocab, seq, batch, micro = LLAMA[model]
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                          num_key_value_heads=kv_heads, intermediate_size=mlp_hidden,
                                          vocab_size=vocab, max_position_embeddings=seq)
        make = transformers.LlamaForCausalLM
    elif model in MIXTRAL:
        layers, hidden, heads, kv_heads, expert_hidden, experts, top_k, vocab = MIXTRAL[model]
        seq, batch, micro = MIXTRAL_BATCH
        config = transformers.MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                            num_key_value_heads=kv_heads, intermediate_size=expert_hidden,
                                            num_local_experts=experts, num_experts_per_tok=top_k, vocab_size=vocab,
                                            max_position_embeddings=seq)
        make = transformers.MixtralForCausalLM
    else:
        layers, hidden, heads, seq, batch, micro = MODELS[model]
        config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq,
                                         vocab_size=51200)
        make = transformers.GPT2LMHeadModel
    with torch.device("meta"):
        built = make(config)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return built, {"input_ids": ids, "labels": ids}, micro


def plan_one(model: str, devices: int) -> dict:
    """Plan one case in this process; returns its figures."""
    import torchpar

    torchpar.init(cluster="local", num_hosts=devices // 8, devices_per_host=8, preset="a100-80g")
    import torch

    from torchpar.cluster import current_cluster

    gpt, batch, micro = build(model)
    method = torchpar.PipeshardParallel(num_micro_batches=micro, layer_option=torchpar.AutoLayerOption(layer_num=16))
    start = time.perf_counter()
    plan = torchpar.plan(gpt, torch.optim.AdamW(gpt.parameters()), example_batch=batch,
                         method=method, mixed_precision="bf16", remat="auto", explain=False)
    total = time.perf_counter() - start
    memory = current_cluster().device_memory_bytes
    headroom = min(1 - s.estimated_memory_bytes / memory for s in plan.stages)
    return {"model": model, "devices": devices, "parameters_b": sum(p.numel() for p in gpt.parameters()) / 1e9,
            "total_s": total, "timings": dict(plan.timings), "stages": len(plan.stages), "remat": plan.remat,
            "estimated_step_s": plan.estimated_step_s, "least_headroom": headroom,
            "ilp_problems": plan.solver.get("ilp_problems")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1.3b,13b,39b,175b", help="GPT-3 sizes and/or mixtral")
    parser.add_argument("--devices", default="64,128,512,1024")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default="benchmarks/results/plan_scaling.json")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "DEVICES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a child process: one case, its figures as the last line of stdout
        print(json.dumps(plan_one(args.one[0], int(args.one[1]))))
        return 0
    rows = []
    for model in args.models.split(","):
        for devices in (int(d) for d in args.devices.split(",")):
            start = time.perf_counter()
            try:
                done = subprocess.run([sys.executable, __file__, "--one", model, str(devices)], capture_output=True,
                                      text=True, timeout=args.timeout)
                row = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else
                       {"model": model, "devices": devices, "error": done.stderr.strip().splitlines()[-1][:300]})
            except subprocess.TimeoutExpired:
                row = {"model": model, "devices": devices, "error": f"no plan within {args.timeout:.0f} s"}
            row.setdefault("wall_s", time.perf_counter() - start)
            rows.append(row)
            print(_line(row), flush=True)
    _growth(rows)
    if args.json:
        write_rows(args.json, rows)
    return 0


def write_rows(path: str, rows: list[dict]) -> None:
    """The benchmark's JSON: this machine's CPU count and one object per case."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as handle:
        json.dump({"machine": {"cpus": os.cpu_count()}, "rows": rows}, handle, indent=2)
    print(f"wrote {path}")


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['model']:>5} {row['devices']:5d}  {row['error']}"
    t = row["timings"]
    return (f"{row['model']:>5} {row['devices']:5d}  total {row['total_s']:6.1f} s  capture {t.get('capture', 0):5.1f}  "
            f"stage DP {t.get('stage_dp', 0):5.1f} (table {t.get('stage_table', 0):4.1f})  ILP {t.get('ilp', 0):5.1f} "
            f"(graphs {t.get('ilp_graphs', 0):4.1f}, CP-SAT {t.get('ilp_solves', 0):4.1f})  remat options "
            f"{t.get('remat_choice', 0):6.1f}  | {row['stages']} stages, remat {row['remat']}, est. step "
            f"{row['estimated_step_s']:.3g} s, least headroom {row['least_headroom']:.1%}")


def _growth(rows: list[dict]) -> None:
    """×2 devices → ×(time ratio), per model, from consecutive measured cases."""
    print("\ngrowth of the planning time (total, capture excluded):")
    for model in dict.fromkeys(r["model"] for r in rows):
        done = [r for r in rows if r["model"] == model and "error" not in r]
        for a, b in zip(done, done[1:]):
            plan_a = a["total_s"] - a["timings"].get("capture", 0)
            plan_b = b["total_s"] - b["timings"].get("capture", 0)
            factor = math.log2(b["devices"] / a["devices"])
            print(f"  {model}: {a['devices']} → {b['devices']} devices (×{b['devices'] / a['devices']:g}): planning "
                  f"×{plan_b / plan_a:.2f} ({(plan_b / plan_a) ** (1 / factor):.2f} per doubling)")


if __name__ == "__main__":
    sys.exit(main())
