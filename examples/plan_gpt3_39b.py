"""Plan GPT-3 39B on 64 V100s of 16 GB the way Alpa's paper does, from the meta device (no weights are allocated).

    python examples/plan_gpt3_39b.py                       # 48 layers × 8192, 8 hosts × 8 V100 16 GB: fits with remat
    python examples/plan_gpt3_39b.py --memory-gib 12       # … 12 GiB devices: nothing fits, and why
    python examples/plan_gpt3_39b.py --layers 4 --hidden 1024 --heads 16 --batch 64 --micro-batches 8 \\
        --layer-num 4 --hosts 2 --devices-per-host 4     # a small version (what the tests run)

The model is a GPT-2-architecture ``GPT2LMHeadModel`` built inside ``torch.device("meta")``; the batch is meta
tensors too. ``torchpar.plan`` captures the training step (AdamW, ``mixed_precision="fp16"``: the V100 has no bf16),
and ``PipeshardParallel`` clusters it into ``--layer-num`` layers, runs the stage DP over the 8 × 8 cluster priced
with the ``v100-16g`` preset, and solves each stage's sharding ILP, with activation checkpointing chosen by the
planner (``remat="auto"``). Every stage must fit the device memory (16 GiB: the planner recomputes each layer,
``remat="layers"``, to fit; ``--memory-gib`` sets another, and where nothing fits it says why). The script prints the plan, the planning time, and the
estimated throughput in model TFLOP/s per GPU (6·N·T + 12·L·d·s·T FLOPs per step over the estimated step time:
an estimate from the cost model at the preset's peak rates, not a measurement) next to Alpa's published figure.
"""

from __future__ import annotations

import argparse
import time

ALPA_TFLOPS_PER_GPU = 57.0
"""Alpa (OSDI'22) on GPT-3 39B over 64 V100s, as the issue quotes it."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=51200)
    parser.add_argument("--batch", type=int, default=1024, help="global batch (sequences per step)")
    parser.add_argument("--micro-batches", type=int, default=64)
    parser.add_argument("--layer-num", type=int, default=16, help="layers formed by operator clustering")
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--devices-per-host", type=int, default=8)
    parser.add_argument("--preset", default="v100-16g")
    parser.add_argument("--memory-gib", type=float, default=None, help="device memory (default: the preset's)")
    parser.add_argument("--out", default="gpt3_39b_plan.html", help="the HTML report")
    parser.add_argument("--json", default=None, help="also write the plan as JSON")
    args = parser.parse_args()

    import torchpar

    memory = {} if args.memory_gib is None else {"device_memory_bytes": int(args.memory_gib * 2**30)}
    cluster = torchpar.init(cluster="local", num_hosts=args.hosts, devices_per_host=args.devices_per_host,
                            preset=args.preset, **memory)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, n_positions=args.seq,
                                     vocab_size=args.vocab)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    parameters = sum(p.numel() for p in model.parameters())
    method = torchpar.PipeshardParallel(num_micro_batches=args.micro_batches,
                                        layer_option=torchpar.AutoLayerOption(layer_num=args.layer_num))
    start = time.perf_counter()
    try:
        plan = torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch={"input_ids": ids,
                             "labels": ids}, method=method, mixed_precision="fp16", remat="auto", explain=False)
    except ValueError as error:  # the planner's answer: no plan fits, and what each option would need
        print(f"no plan after {time.perf_counter() - start:.1f} s:\n{error}\n(try a larger --memory-gib)")
        return
    planning_s = time.perf_counter() - start
    print("\n".join(line for line in plan.summary().splitlines()  # each stage's memory, not its per-tensor lines
                    if not line.startswith("    ") or line.lstrip().startswith("est. memory")))
    tokens = args.batch * args.seq
    flops = 6 * parameters * tokens + 12 * args.layers * args.hidden * args.seq * tokens
    devices = args.hosts * args.devices_per_host
    tflops = flops / plan.estimated_step_s / devices / 1e12
    peak = cluster.device_flops / 1e12
    print(f"\n{parameters / 1e9:.1f} B parameters, {devices} devices, planned in {planning_s:.1f} s "
          f"(capture {plan.timings.get('capture', 0):.1f} s)")
    print(f"estimated step {plan.estimated_step_s:.2f} s: {tflops:.1f} model TFLOP/s per GPU "
          f"({tflops / peak:.0%} of the preset's {peak:.0f} TFLOP/s peak); Alpa published ~{ALPA_TFLOPS_PER_GPU:.0f}")
    fits = all(stage.estimated_memory_bytes <= cluster.device_memory_bytes for stage in plan.stages)
    print(f"every stage fits {cluster.device_memory_bytes / 2**30:.0f} GiB per device: {fits}")
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    plan.save_html(args.out, param_shapes=shapes, title=f"GPT-3 {parameters / 1e9:.0f}B on {devices} {args.preset}")
    print(f"HTML report written to {args.out}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            file.write(plan.to_json())


if __name__ == "__main__":
    main()
