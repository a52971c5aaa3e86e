"""Single-device step time: torchpar vs PyTorch eager (and torch.compile where it runs).

    python benchmarks/single_device.py [--steps 10] [--warmup 3] [--sizes small,medium] [--json out.json]
    python benchmarks/single_device.py --families all --sizes medium     # the CPU floor: six families

For each model the three runners train the same model (same init, same batch, AdamW) and are timed
interleaved — one step of each per round — so machine noise hits them alike; the table reports the
median step time of each and the ratios to eager measured in the same run.
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
from typing import Any, Callable

import torch

SIZES: dict[str, dict[str, tuple[dict[str, Any], int, int]]] = {
    # family -> size -> (config overrides, batch size, sequence length)
    "gpt2": {
        "small": ({"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 4096, "n_positions": 128}, 8, 64),
        "medium": ({"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 128}, 8, 128),
        "large": ({"n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 8192, "n_positions": 128}, 8, 128),
    },
    "llama": {
        "small": ({"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 4096}, 8, 64),
        "medium": ({"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "vocab_size": 8192}, 8, 128),
        "large": ({"num_hidden_layers": 6, "hidden_size": 384, "intermediate_size": 1024, "num_attention_heads": 6,
                   "num_key_value_heads": 2, "vocab_size": 8192}, 8, 128),
    },
    "bert": {  # masked LM, every third label ignored
        "small": ({"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
                   "vocab_size": 4096}, 8, 64),
        "medium": ({"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4,
                    "vocab_size": 8192}, 8, 128),
    },
    "vit": {  # image classification; the "sequence length" is unused (patches: (image / patch)² + 1)
        "small": ({"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
                   "image_size": 32, "patch_size": 4}, 8, 0),
        "medium": ({"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4,
                    "image_size": 64, "patch_size": 8}, 16, 0),
    },
    "resnet": {  # bottleneck blocks on 32 × 32 images
        "small": ({"embedding_size": 32, "hidden_sizes": [32, 64], "depths": [1, 1]}, 16, 0),
        "medium": ({"embedding_size": 32, "hidden_sizes": [64, 128, 256, 512], "depths": [1, 1, 1, 1]}, 16, 0),
    },
    "mixtral": {  # 8 experts, top-2, router logits in the loss
        "small": ({"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 4096}, 8, 64),
        "medium": ({"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "vocab_size": 8192}, 8, 128),
    },
}
CPU_FLOOR_FAMILIES = "gpt2,llama,bert,vit,resnet,mixtral"
"""The families of the CPU floor (issue 50: no family slower than eager): ``--families all``."""


def _torch_step(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> Callable[[], float]:
    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def _compiled_torch_step(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> Callable[[], float] | None:
    try:
        compiled_model = torch.compile(model)

        @torch.compile
        def opt_step() -> None:
            optimizer.step()

        def step() -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = compiled_model(**batch).loss
            loss.backward()
            opt_step()
            return loss.item()

        step()  # compile now, so a failure is caught here
        return step
    except Exception as error:  # torch.compile needs a working C++ toolchain; report and go on
        print(f"  torch.compile unavailable: {type(error).__name__}: {str(error).splitlines()[0][:120]}", file=sys.stderr)
        return None


def measure(family: str, size: str, steps: int, warmup: int, with_torch_compile: bool) -> dict[str, Any]:
    import torchpar
    from torchpar.harness import zoo

    overrides, batch_size, seq_len = SIZES[family][size]
    torch.manual_seed(0)
    model, batch = zoo.build(family, overrides, batch_size=batch_size, seq_len=seq_len)
    params = sum(p.numel() for p in model.parameters())
    eager_model, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
    eager_model.train()
    compiled_model.train()
    runners: dict[str, Callable[[], float]] = {
        "eager": _torch_step(eager_model, batch, torch.optim.AdamW(eager_model.parameters(), lr=1e-4)),
    }
    start = time.perf_counter()
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-4), example_batch=batch)
    compile_s = time.perf_counter() - start
    runners["torchpar"] = lambda: engine.step(batch).item()
    if with_torch_compile:
        compiled = _compiled_torch_step(compiled_model, batch, torch.optim.AdamW(compiled_model.parameters(), lr=1e-4))
        if compiled is not None:
            runners["torch.compile"] = compiled
    times: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(warmup + steps):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run()
            elapsed = time.perf_counter() - t0
            if round_index >= warmup:
                times[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "family": family, "size": size, "params": params, "batch": [batch_size, seq_len],
        "config": overrides, "torchpar_compile_s": compile_s,
        "median_step_s": medians,
        "ratio_to_eager": {name: medians[name] / medians["eager"] for name in medians},
        "all_step_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="gpt2,llama", help=f"comma-separated, or 'all' ({CPU_FLOOR_FAMILIES})")
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per runner (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-torch-compile", action="store_true", help="skip the torch.compile runner")
    parser.add_argument("--json", default="benchmarks/results/single_device.json")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    results = []
    header = f"{'model':<14}{'params':>10}{'eager ms':>11}{'torchpar ms':>13}{'compile ms':>12}{'tp/eager':>10}{'tc/eager':>10}"
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus")
    print(header)
    families = CPU_FLOOR_FAMILIES if args.families == "all" else args.families
    for family in families.split(","):
        for size in args.sizes.split(","):
            result = measure(family, size, args.steps, args.warmup, not args.no_torch_compile)
            results.append(result)
            m, r = result["median_step_s"], result["ratio_to_eager"]
            tc_ms = f"{m['torch.compile'] * 1e3:12.1f}" if "torch.compile" in m else f"{'-':>12}"
            tc_ratio = f"{r['torch.compile']:10.2f}" if "torch.compile" in r else f"{'-':>10}"
            print(f"{family + '/' + size:<14}{result['params'] / 1e6:>9.1f}M{m['eager'] * 1e3:11.1f}"
                  f"{m['torchpar'] * 1e3:13.1f}{tc_ms}{r['torchpar']:10.2f}{tc_ratio}", flush=True)
    if len(results) > 1:
        geomean = lambda key: statistics.geometric_mean(r["ratio_to_eager"][key] for r in results)
        line = f"geometric mean: torchpar / eager {geomean('torchpar'):.2f}"
        if all("torch.compile" in r["ratio_to_eager"] for r in results):
            compiled = statistics.geometric_mean(
                r["median_step_s"]["torchpar"] / r["median_step_s"]["torch.compile"] for r in results)
            line += f", torchpar / torch.compile {compiled:.2f}"
        print(line)
    import jax

    meta = {"torch": torch.__version__, "jax": jax.__version__, "device": str(jax.devices()[0]),
            "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "steps": args.steps, "warmup": args.warmup}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"meta": meta, "results": results}, handle, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
