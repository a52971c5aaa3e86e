"""Plan mixture-of-experts models on 8 hosts × 8 GPUs from the meta device: Mixtral-8×7B and a GShard-style MoE of
about 70B (Alpa's largest MoE), with their experts split over devices (expert parallelism) where the cost model says
it pays.

    python examples/plan_moe.py                                  # Mixtral-8×7B, 8 × 8 A100 80 GB
    python examples/plan_moe.py --model gshard-70b --preset v100-16g
    python examples/plan_moe.py --model mixtral --experts 8 --layers 2 --hidden 512 --expert-hidden 1024 \\
        --batch 64 --seq 256 --micro-batches 8 --hosts 1 --layer-num 2   # a small version, in seconds

Both models are HF ``MixtralForCausalLM`` built inside ``torch.device("meta")`` (no weights): top-2 routing over
SwiGLU experts through transformers' ``grouped_mm`` experts path, the router's load-balancing loss included.
``gshard-70b`` takes Alpa's 70B MoE shape (32 layers, hidden 2048, 64 experts, 1,024 × 2,048 tokens a step) with
SwiGLU experts of 5,504 (two thirds of GShard's 8,192, so the expert parameters stay at 69 B). ``torchpar.plan``
captures the training step (AdamW, bf16 mixed precision; fp16 on V100), ``PipeshardParallel`` clusters it into
``--layer-num`` layers, the stage DP places stages on submeshes, and each stage's sharding ILP chooses every
tensor's layout — for each grouped matmul: replicated experts, rows split, each expert's hidden dims split, or the
experts split over a mesh axis with tokens exchanged by all-to-all (priced for a balanced router). The script prints
the planning time, each stage's memory against the device's, and which stages split their experts over which axis.
"""

from __future__ import annotations

import argparse
import json
import time

MODELS = {  # layers, hidden, heads, KV heads, expert hidden, experts, top-k, vocab, sequence, batch, micro-batches
    "mixtral": (32, 4096, 32, 8, 14336, 8, 2, 32000, 2048, 1024, 128),
    "gshard-70b": (32, 2048, 32, 32, 5504, 64, 2, 32000, 2048, 1024, 128),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="mixtral")
    for name in ("layers", "hidden", "heads", "kv-heads", "expert-hidden", "experts", "top-k", "vocab", "seq",
                 "batch", "micro-batches"):
        parser.add_argument(f"--{name}", type=int, default=None, help="override the model's shape")
    parser.add_argument("--layer-num", type=int, default=16, help="layers formed by operator clustering")
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--devices-per-host", type=int, default=8)
    parser.add_argument("--preset", default="a100-80g")
    parser.add_argument("--remat", default="selective", help="activation checkpointing (auto plans every option)")
    parser.add_argument("--split-experts", action="store_true", help="experts='split': no other layout for them")
    parser.add_argument("--json", default=None, help="append this case's figures to the rows of this JSON file")
    args = parser.parse_args()
    shape = dict(zip(("layers", "hidden", "heads", "kv_heads", "expert_hidden", "experts", "top_k", "vocab", "seq",
                      "batch", "micro_batches"), MODELS[args.model]))
    shape.update({k: v for k, v in vars(args).items() if k in shape and v is not None})

    import torchpar

    cluster = torchpar.init(cluster="local", num_hosts=args.hosts, devices_per_host=args.devices_per_host,
                            preset=args.preset)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.MixtralConfig(
        num_hidden_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], intermediate_size=shape["expert_hidden"],
        num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"], vocab_size=shape["vocab"],
        max_position_embeddings=shape["seq"], output_router_logits=True)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
        ids = torch.zeros(shape["batch"], shape["seq"], dtype=torch.long)
    parameters = sum(p.numel() for p in model.parameters())
    method = torchpar.PipeshardParallel(num_micro_batches=shape["micro_batches"],
                                        layer_option=torchpar.AutoLayerOption(layer_num=args.layer_num),
                                        experts="split" if args.split_experts else "auto")
    mixed = "fp16" if args.preset.startswith("v100") else "bf16"
    start = time.perf_counter()
    figures = {"model": args.model, "preset": args.preset, "devices": cluster.num_devices,
               "parameters_b": parameters / 1e9, "remat": args.remat, "shape": shape}
    try:
        plan = torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch={"input_ids": ids,
                             "labels": ids}, method=method, mixed_precision=mixed, remat=args.remat, explain=False)
    except ValueError as error:  # the planner's answer: no plan fits, and what it would need
        figures.update(planning_s=time.perf_counter() - start, error=str(error).splitlines()[0])
        print(f"no plan after {figures['planning_s']:.1f} s:\n{error}")
        _write(args.json, figures)
        return
    planning_s = time.perf_counter() - start
    print("\n".join(line for line in plan.summary().splitlines()
                    if not line.startswith("    ") or line.lstrip().startswith(("est. memory", "experts:", "routing:"))))
    memory = cluster.device_memory_bytes
    split = [index for index, stage in enumerate(plan.stages)
             if any(spec[0] for name, spec in stage.params.items() if ".experts." in name)]
    figures.update(planning_s=planning_s, capture_s=plan.timings.get("capture", 0.0), stages=len(plan.stages),
                   estimated_step_s=plan.estimated_step_s, remat=plan.remat,
                   least_headroom=min(1 - s.estimated_memory_bytes / memory for s in plan.stages),
                   stages_with_experts_split=split,
                   stages_with_experts=[i for i, s in enumerate(plan.stages) if any(".experts." in n for n in s.params)],
                   row_exchanges=[sum(label.endswith(",exchange") for label in s.strategies.values())
                                  for s in plan.stages])
    print(f"\n{parameters / 1e9:.1f} B parameters on {cluster.num_devices} × {args.preset}: planned in "
          f"{planning_s:.1f} s (capture {figures['capture_s']:.1f} s); {len(plan.stages)} stages, the least memory "
          f"headroom {figures['least_headroom']:.1%}; experts split in stages {split} of "
          f"{figures['stages_with_experts']}; gathers/puts moving rows by all-to-all per stage "
          f"{figures['row_exchanges']}")
    _write(args.json, figures)


def _write(path: str | None, figures: dict) -> None:
    """Append ``figures`` to the ``rows`` of the JSON file at ``path`` (created if missing)."""
    if not path:
        return
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        data = {"rows": []}
    data["rows"].append(figures)
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2)


if __name__ == "__main__":
    main()
