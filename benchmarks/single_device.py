"""Single-device step time: torchpar vs PyTorch eager (and torch.compile where it runs).

    python benchmarks/single_device.py [--steps 10] [--warmup 3] [--sizes small,medium] [--json out.json]
    python benchmarks/single_device.py --families all --sizes medium     # the CPU floor: six families

For each model the three runners train the same model (same init, same batch, AdamW) and are timed
interleaved, so machine noise hits them alike; the table reports the median step time of each and the ratios to
eager measured in the same run. Each runner lives in its own process and the runners take turns of a few steps
(:func:`measure`): in one process PyTorch's OpenMP workers spin after every eager or torch.compile step and take a
core from the XLA step that follows (ViT: torchpar / eager 1.04 with eager alone beside it, 1.20 with torch.compile in
the same rotation). ``--in-process`` keeps the earlier protocol (one step of each per round, one process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

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


def _runner(name: str, family: str, size: str) -> tuple[Callable[[], float] | None, dict[str, Any]]:
    """One runner's step on its own copy of the model (seed 0: every runner trains the same model on the same batch)
    and what building it took; ``None`` where torch.compile is unavailable."""
    import torchpar
    from torchpar.harness import zoo

    overrides, batch_size, seq_len = SIZES[family][size]
    torch.manual_seed(0)
    model, batch = zoo.build(family, overrides, batch_size=batch_size, seq_len=seq_len)
    model.train()
    info: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "eager":
        return _torch_step(model, batch, optimizer), info
    if name == "torch.compile":
        return _compiled_torch_step(model, batch, optimizer), info
    start = time.perf_counter()
    engine = torchpar.compile(model, optimizer, example_batch=batch)
    info["torchpar_compile_s"] = time.perf_counter() - start
    return (lambda: engine.step(batch).item()), info


def _runner_process(conn, name: str, family: str, size: str) -> None:
    """A runner in its own process: build it, report, then run the number of steps each message asks for and send
    back their times, until a ``None``."""
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "torchpar":  # first, as a user does: before JAX or torch start threads (torchpar.host_heap)
        import torchpar

        torchpar.init(cluster="local", num_devices=1)
    run, info = _runner(name, family, size)
    conn.send(info if run is not None else None)
    while (count := conn.recv()) is not None:
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        conn.send(times)


def measure(family: str, size: str, steps: int, warmup: int, with_torch_compile: bool,
            isolated: bool = True, turn: int = 3) -> dict[str, Any]:
    """Median step time of each runner. ``isolated`` (the default): each runner in its own process, built one after
    another, then turns of ``turn`` steps each, the runners' order reversed every other round, so no runner's threads
    share a process with another's (in one process PyTorch's OpenMP workers spin after each eager step and take a core
    from the XLA step that follows). ``isolated=False``: the three in one process, one step each per round."""
    names = ["eager", "torchpar"] + (["torch.compile"] if with_torch_compile else [])
    overrides, batch_size, seq_len = SIZES[family][size]
    info: dict[str, Any] = {}
    times: dict[str, list[float]] = {}
    if isolated:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        workers = {}
        try:
            for name in names:
                parent, child = context.Pipe()
                process = context.Process(target=_runner_process, args=(child, name, family, size), daemon=True)
                process.start()
                built = parent.recv()
                if built is None:
                    process.join(timeout=60)
                    continue
                info.update(built)
                workers[name] = (process, parent)
                parent.send(warmup)
                parent.recv()
            times = {name: [] for name in workers}
            rounds = -(-steps // turn)
            for round_index in range(rounds):
                order = list(workers) if round_index % 2 == 0 else list(reversed(workers))
                for name in order:
                    workers[name][1].send(turn)
                    times[name].extend(workers[name][1].recv())
        finally:
            for process, conn in workers.values():
                conn.send(None)
                process.join(timeout=60)
                if process.is_alive():
                    process.kill()
    else:
        runners = {}
        for name in names:
            run, built = _runner(name, family, size)
            if run is not None:
                runners[name] = run
                info.update(built)
        times = {name: [] for name in runners}
        for round_index in range(warmup + steps):
            for name, run in runners.items():
                t0 = time.perf_counter()
                run()
                elapsed = time.perf_counter() - t0
                if round_index >= warmup:
                    times[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "family": family, "size": size, "params": info["params"], "batch": [batch_size, seq_len],
        "config": overrides, "torchpar_compile_s": info.get("torchpar_compile_s"), "isolated": isolated,
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
    parser.add_argument("--in-process", action="store_true",
                        help="the runners in one process, one step each per round (the protocol before 2026-11-29)")
    parser.add_argument("--json", default="benchmarks/results/single_device.json")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    results = []
    header = (f"{'model':<14}{'params':>10}{'eager ms':>11}{'torchpar ms':>13}{'compile ms':>12}{'tp/eager':>10}"
              f"{'tc/eager':>10}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus")
    print(header)
    families = CPU_FLOOR_FAMILIES if args.families == "all" else args.families
    for family in families.split(","):
        for size in args.sizes.split(","):
            result = measure(family, size, args.steps, args.warmup, not args.no_torch_compile,
                             isolated=not args.in_process)
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
