"""The planner's per-device memory estimate against XLA's memory analysis of the compiled step.

    python benchmarks/memory_model.py                      # GPT-2, Llama, BERT, ResNet × one device, DP, ZeRO-3,
                                                           # Megatron, a 2-stage pipeline on 4 fake CPU devices
    python benchmarks/memory_model.py --families gpt2 --methods one_device,zero3

For every (model, method): compile, run one step, and compare each stage's ``estimated_memory_bytes`` (the plan's one
memory model: parameters, gradients, optimizer state, activations kept for the backward per micro-batch in flight,
buffers) with ``engine.measured()["memory_bytes"]`` (XLA's ``arguments + outputs − aliased + temporaries`` of the
stage's executables, the largest of them). The error is ``estimate / compiled − 1`` per stage. A pipeline stage's
executables hold one micro-batch's residuals; the plan's estimate counts its schedule's micro-batches in flight, so
for pipeline stages the estimate is compared with the compiled figure plus the other in-flight micro-batches'
residuals as the plan counts them (its activation part × (in flight − 1) / in flight).

Prints a table and writes ``benchmarks/results/memory_model.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILY_CONFIGS = {
    "gpt2": ({"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1024}, 8, 64),
    "llama": ({"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 1024}, 8, 64),
    "bert": ({"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
              "vocab_size": 1024}, 8, 64),
    "resnet": ({"embedding_size": 32, "hidden_sizes": [32, 64], "depths": [1, 1]}, 32, 0),
}
"""family → (config overrides, batch size, sequence length) for :func:`torchpar.harness.zoo.build`."""
METHODS = ("one_device", "data_parallel", "zero2", "zero3", "megatron", "pipeline")


def method_of(name: str):
    import torchpar

    return {
        "one_device": None,
        "data_parallel": torchpar.DataParallel(),
        "zero2": torchpar.Zero2Parallel(),
        "zero3": torchpar.Zero3Parallel(),
        "megatron": torchpar.MegatronParallel(mesh_shape=(1, 4)),
        "pipeline": torchpar.PipeshardParallel(num_micro_batches=2, layer_option=torchpar.AutoLayerOption(layer_num=2),
                                               stage_option=torchpar.ManualStageOption(
                                                   forward_stage_layer_ids=[[0], [1]],
                                                   submesh_physical_shapes=[(1, 2), (1, 2)],
                                                   submesh_logical_shapes=[(2, 1), (2, 1)])),
    }[name]


def measure(family: str, method: str, library_fusions: bool = False) -> list[dict]:
    """Per stage: estimated and compiled per-device bytes of ``family`` trained with ``method`` (one step)."""
    import torch

    import torchpar
    from torchpar.harness.zoo import build

    overrides, batch_size, seq_len = FAMILY_CONFIGS[family]
    torch.manual_seed(0)
    model, batch = build(family, overrides, batch_size=batch_size, seq_len=seq_len or 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # XLA's CPU library fusions (YNNPACK / oneDNN matmuls, on by default for speed) keep operands and outputs of every
    # matmul in buffers of their own: +137% temporaries on GPT-2 one device. The estimate models XLA's own fusion
    # (what a GPU compiles), so the comparison compiles without them.
    with torchpar.compile(model, optimizer, example_batch=batch, method=method_of(method),
                          xla_library_fusions=library_fusions) as engine:
        engine.step(batch)
        compiled = engine.measured()["memory_bytes"]
        plan = engine.plan
        rows = []
        in_flight = _in_flight(plan)
        for index, stage in enumerate(plan.stages):
            estimate = float(stage.estimated_memory_bytes)
            measured = float(compiled[index])
            activations = float((stage.memory_breakdown or {}).get("activations", 0.0))
            held = in_flight[index]
            compared = measured + activations * (held - 1) / held if held > 1 else measured
            rows.append({"family": family, "method": method, "stage": index, "estimated_bytes": estimate,
                         "compiled_bytes": measured, "compared_bytes": compared, "in_flight": held,
                         "error": estimate / compared - 1.0})
        return rows


def _in_flight(plan) -> list[int]:
    if len(plan.stages) == 1:
        return [1]
    from torchpar.planner.pipeline.stages import micro_batches_in_flight

    return micro_batches_in_flight(len(plan.stages), plan.num_micro_batches, plan.schedule)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILY_CONFIGS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--library-fusions", action="store_true", help="compile with XLA's CPU library fusions")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_model.json"))
    args = parser.parse_args()
    import torchpar

    torchpar.init(cluster="local", num_devices=4, compile_cache=False)
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for family in args.families.split(","):
        for method in args.methods.split(","):
            for row in measure(family, method, args.library_fusions):
                rows.append(row)
                print(f"{family:7s} {method:14s} stage {row['stage']}: estimated {row['estimated_bytes'] / 2**20:8.2f} "
                      f"MiB, compiled {row['compiled_bytes'] / 2**20:8.2f} MiB (compared {row['compared_bytes'] / 2**20:8.2f},"
                      f" {row['in_flight']} in flight): {row['error']:+.1%}", flush=True)
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"\nworst: {worst['family']} {worst['method']} stage {worst['stage']}: {worst['error']:+.1%}; "
          f"mean |error| {sum(abs(r['error']) for r in rows) / len(rows):.1%} over {len(rows)} stages")
    Path(args.out).write_text(json.dumps({"rows": rows, "cpu_count": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
