"""One GPU: step time, tokens/s and MFU of PyTorch eager, torch.compile and torchpar, per precision mode.

    python benchmarks/gpu_single.py [--models gpt2,llama1b] [--modes fp32,tf32,bf16] [--steps 20] [--warmup 5]
                                    [--runners eager,compile,torchpar] [--profile-compile] [--out FILE]
    python benchmarks/gpu_single.py --smoke          # tiny configs, 2 steps, on the CPU if there is no GPU

Models (random weights and token ids, nothing downloaded), trained with AdamW(lr=1e-4):

| name | model | batch |
|---|---|---|
| ``gpt2`` | ``GPT2LMHeadModel(GPT2Config())``: 124 M, 12 layers, d=768 (dropout 0.1 as configured) | 8 × 1024 |
| ``llama1b`` | ``LlamaForCausalLM``: 16 layers, d=2048, MLP 5632, 16 heads, vocab 32000: 0.95 B | 4 × 2048 |

Precision modes (the same for every runner):

| mode | PyTorch | torchpar |
|---|---|---|
| ``fp32`` | ``torch.set_float32_matmul_precision("highest")`` | ``compile(..., matmul_precision="highest")`` |
| ``tf32`` | ``"high"`` | ``matmul_precision="high"`` |
| ``bf16`` | ``torch.autocast("cuda", torch.bfloat16)``, fp32 weights | ``mixed_precision="bf16"``, ``matmul_precision="highest"`` |

Each (model, mode) runs in a fresh process (clean GPU memory; one crash loses one row). In it the runners are
built one after another, then timed interleaved: every round runs one step of each runner, so drift and
noise hit all alike; a torch step ends with ``loss.item()`` and ``torch.cuda.synchronize()``, torchpar's
``engine.step`` returns the loss as a CPU tensor (it waits for the step). Reported per runner:

- the median step time over ``--steps`` rounds after ``--warmup``, tokens/s = B·S / step, and the ratio to eager;
- MFU = F / t / P. F = 6·N·T + 12·L·d·S·T model FLOPs per step (T = B·S tokens; N = parameters that multiply:
  all but input embedding tables, a tied output head counted once; L layers, d width, S sequence length:
  forward + backward = 3 × forward's 2·N·T, and attention's QKᵀ and AV, 4·S·d per token and layer forward,
  with no causal discount). P = the GPU's dense peak at the mode's precision: bf16 is the
  ``torchpar.hardware`` preset's ``device_flops``, TF32 half of it, fp32 the CUDA-core rate
  (:data:`FP32_PEAKS`); ``--preset`` picks the preset (default: from the GPU's name);
- the first step's seconds ("compile"): eager's first step, torch.compile's (Dynamo + Inductor), and for
  torchpar ``torchpar.compile`` plus its first step, with its phases (``engine.plan.timings``: capture, lower,
  xla_compile);
- torchpar's "cached compile": a second fresh process builds the same engine with the persistent compilation
  cache the first one filled (``torchpar/compile_cache.py``), with the cache hits it got.

Every cache starts empty (a fresh temporary directory for JAX's, Inductor's and Triton's caches, per model and
mode) unless ``--keep-caches``. ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` lets torch and JAX share the GPU;
when they do not fit together (``llama1b`` in fp32 needs ≈ 11 GB of weights and AdamW state per runner, plus
activations), the row says which runner ran out of memory: time fewer at once with ``--runners``.

``--profile-compile``: the torchpar compile again in fresh processes with the cache off, once per
``--autotune-levels`` (GPU only: ``XLA_FLAGS=--xla_gpu_autotune_level=N``, 0 = no autotuning, 4 = XLA's
default), split into capture / lower / XLA compile, so the rows show how much of the XLA compile is autotuning.
On the CPU (``--smoke``) one such process runs with the default flags.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

import argparse
import contextlib
import copy
import gc
import inspect
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(kw_only=True, frozen=True)
class Workload:
    """A model and its batch."""

    family: str
    """``"gpt2"`` or ``"llama"`` (HF transformers)."""
    config: dict[str, Any]
    """Fields of the transformers config (``GPT2Config`` / ``LlamaConfig``)."""
    batch_size: int
    seq_len: int


@dataclass(kw_only=True, frozen=True)
class Mode:
    """A precision mode (module docstring)."""

    matmul_precision: str
    """``torch.set_float32_matmul_precision`` and torchpar's ``matmul_precision``."""
    mixed_precision: str | None = None
    """``"bf16"``: torch.autocast for PyTorch, ``mixed_precision="bf16"`` for torchpar."""
    peak: str = "fp32"
    """Which peak MFU divides by: ``"fp32"``, ``"tf32"`` or ``"bf16"``."""


WORKLOADS: dict[str, Workload] = {
    "gpt2": Workload(family="gpt2", config={}, batch_size=8, seq_len=1024),
    "llama1b": Workload(family="llama", config={"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 5632,
                                                "num_attention_heads": 16, "vocab_size": 32000,
                                                "max_position_embeddings": 2048}, batch_size=4, seq_len=2048),
}
SMOKE_WORKLOADS: dict[str, Workload] = {
    "gpt2": Workload(family="gpt2", config={"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256,
                                            "n_positions": 64}, batch_size=2, seq_len=32),
    "llama1b": Workload(family="llama", config={"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 176,
                                                "num_attention_heads": 2, "vocab_size": 256,
                                                "max_position_embeddings": 64}, batch_size=2, seq_len=32),
}
MODES: dict[str, Mode] = {
    "fp32": Mode(matmul_precision="highest", peak="fp32"),
    "tf32": Mode(matmul_precision="high", peak="tf32"),
    "bf16": Mode(matmul_precision="highest", mixed_precision="bf16", peak="bf16"),
}
RUNNERS = ("eager", "compile", "torchpar")
"""PyTorch eager, torch.compile, torchpar."""
FP32_PEAKS: dict[str, float] = {"h100-sxm": 67e12, "a100-sxm": 19.5e12, "v100-p3": 15.7e12}
"""Dense fp32 FLOP/s on CUDA cores (vendor spec sheets); ``torchpar.hardware`` presets hold the bf16 peak only."""
TF32_FRACTION: dict[str, float] = {"h100-sxm": 0.5, "a100-sxm": 0.5, "v100-p3": FP32_PEAKS["v100-p3"] / 125e12}
"""Dense TF32 tensor-core peak as a fraction of the bf16 one (V100 has no TF32: its fp32 rate)."""


def peak_flops(preset_name: str, precision: str) -> float:
    """The GPU's dense peak FLOP/s at ``precision`` (``"fp32"``, ``"tf32"``, ``"bf16"``)."""
    from torchpar.hardware import preset

    bf16 = preset(preset_name).device_flops
    if precision == "bf16":
        return bf16
    if precision == "tf32":
        return bf16 * TF32_FRACTION.get(preset_name, 0.5)
    return FP32_PEAKS.get(preset_name, bf16 / 16)


def preset_for(device_name: str) -> str:
    """The ``torchpar.hardware`` preset of a GPU by its name (H200 computes at H100 SXM's rates)."""
    name = device_name.upper()
    for key, preset_name in (("H100", "h100-sxm"), ("H200", "h100-sxm"), ("A100", "a100-sxm"), ("V100", "v100-p3")):
        if key in name:
            return preset_name
    return "h100-sxm"


# --- the model and its FLOPs ------------------------------------------------------------------------------------


def build(workload: Workload) -> tuple[Any, dict[str, Any]]:
    """The model (fp32, on the CPU, train mode, seed 0) and a batch of random token ids."""
    import torch
    import transformers

    torch.manual_seed(0)
    if workload.family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**workload.config))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**workload.config))
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (workload.batch_size, workload.seq_len))
    return model, {"input_ids": ids, "labels": ids}


def matmul_params(model: Any) -> int:
    """N of the FLOP count: every parameter but the input embedding tables (a lookup multiplies nothing); a table
    tied to an output Linear (GPT-2's ``wte`` = ``lm_head``) is the head's weight and counts once."""
    import torch

    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)
               and id(m.weight) not in linear_weights}
    return sum(p.numel() for p in model.parameters()) - sum(lookups.values())


def flops_per_step(model: Any, workload: Workload) -> float:
    """F = 6·N·T + 12·L·d·S·T (module docstring)."""
    tokens = workload.batch_size * workload.seq_len
    layers, width = model.config.num_hidden_layers, model.config.hidden_size
    return 6 * matmul_params(model) * tokens + 12 * layers * width * workload.seq_len * tokens


# --- the runners ------------------------------------------------------------------------------------------------


@dataclass
class Runner:
    """One way of training the model, ready to time."""

    step: Callable[[], float]
    """One training step, finished (synchronized) when it returns; returns the loss."""
    first_step_s: float
    """Seconds from nothing to the first step done (torchpar: ``compile_s`` + its first step)."""
    compile_s: float | None = None
    """torchpar: seconds in ``torchpar.compile``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """torchpar: the engine, its compile phases, numerics and cache hits."""


def _autocast(device: str, mode: Mode) -> contextlib.AbstractContextManager[Any]:
    import torch

    return torch.autocast(device, dtype=torch.bfloat16) if mode.mixed_precision == "bf16" else contextlib.nullcontext()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def torch_runner(model: Any, batch: dict, device: str, mode: Mode, compiled: bool) -> Runner:
    """PyTorch eager, or with ``torch.compile`` on the model and the optimizer step."""
    import torch

    model = model.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(model) if compiled else model

    def optimizer_step() -> None:
        optimizer.step()

    update = torch.compile(optimizer_step) if compiled else optimizer_step

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with _autocast(device, mode):
            loss = forward(**batch).loss
        loss.backward()
        update()
        value = loss.item()
        _sync(device)
        return value

    start = time.perf_counter()
    step()
    return Runner(step=step, first_step_s=time.perf_counter() - start)


def torchpar_runner(model: Any, batch: dict, mode: Mode) -> Runner:
    """``torchpar.compile`` of the model (on the CPU: torchpar places the state on the JAX device itself)."""
    import torch

    import torchpar
    from torchpar import compile_cache
    options = {"matmul_precision": mode.matmul_precision}
    if mode.mixed_precision is not None:
        options["mixed_precision"] = mode.mixed_precision
    missing = sorted(set(options) - set(inspect.signature(torchpar.compile).parameters))
    if missing:
        raise NotImplementedError(f"skipped: the installed torchpar.compile has no {', '.join(missing)}= option")
    hits_before = compile_cache.hits()
    start = time.perf_counter()
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-4), example_batch=batch, **options)
    compile_s = time.perf_counter() - start
    engine.step(batch)
    first_step_s = time.perf_counter() - start
    return Runner(step=lambda: engine.step(batch).item(), first_step_s=first_step_s, compile_s=compile_s,
                  extra={"engine": engine, "phases": dict(engine.plan.timings), "numerics": engine.numerics,
                         "cache_hits": compile_cache.hits() - hits_before, "cache_dir": compile_cache.cache_dir()})


def _error(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}" if not isinstance(error, NotImplementedError) else first


def _free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


# --- one (model, mode), in a child process ----------------------------------------------------------------------


def _device(smoke: bool) -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if not smoke:
        raise SystemExit("gpu_single.py needs a CUDA GPU (check the script on the CPU with --smoke)")
    return "cpu"


def _init_torchpar(cache: str | bool) -> None:
    import torchpar

    torchpar.init(cluster="local", num_devices=1, compile_cache=cache)


def measure(name: str, mode_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build the runners of one (model, mode), time them interleaved, return the row."""
    import torch

    device = _device(args.smoke)
    mode = MODES[mode_name]
    workload = (SMOKE_WORKLOADS if args.smoke else WORKLOADS)[name]
    torch.set_float32_matmul_precision(mode.matmul_precision)
    _init_torchpar(args.cache_dir or False)
    model, batch = build(workload)
    row: dict[str, Any] = {"model": name, "mode": mode_name, "workload": asdict(workload), "device": device,
                           "params": sum(p.numel() for p in model.parameters()), "matmul_params": matmul_params(model),
                           "flops_per_step": flops_per_step(model, workload),
                           "tokens_per_step": workload.batch_size * workload.seq_len, "runners": {}}
    if device == "cuda":
        row["gpu"] = torch.cuda.get_device_name(0)
    runners: dict[str, Runner] = {}
    for runner in args.runners:
        try:
            if runner == "torchpar":
                runners[runner] = torchpar_runner(copy.deepcopy(model), batch, mode)
            else:
                runners[runner] = torch_runner(copy.deepcopy(model), batch, device, mode, compiled=runner == "compile")
        except Exception as error:  # noqa: BLE001 (a runner that fails to build: OOM, no C++ compiler... is a row)
            row["runners"][runner] = {"error": _error(error)}
            _free_memory(device)
    times: dict[str, list[float]] = {runner: [] for runner in runners}
    for round_index in range(args.warmup + args.steps):
        for runner_name, runner in list(runners.items()):
            start = time.perf_counter()
            try:
                runner.step()
            except Exception as error:  # noqa: BLE001 (e.g. out of memory: reported in the row, the others go on)
                row["runners"][runner_name] = {"error": f"step {round_index}: {_error(error)}"}
                del runners[runner_name], times[runner_name]
                _free_memory(device)
                continue
            if round_index >= args.warmup:
                times[runner_name].append(time.perf_counter() - start)
    preset_name = args.preset or preset_for(row.get("gpu", ""))
    peak = peak_flops(preset_name, mode.peak)
    row.update(preset=preset_name, peak_flops=peak)
    for runner_name, runner in runners.items():
        median = statistics.median(times[runner_name])
        result = {"median_step_s": median, "tokens_per_s": row["tokens_per_step"] / median,
                  "mfu": row["flops_per_step"] / median / peak if device == "cuda" else None,
                  "first_step_s": runner.first_step_s, "steps_s": times[runner_name]}
        if runner.compile_s is not None:
            result.update(compile_s=runner.compile_s, phases=runner.extra["phases"],
                          numerics=runner.extra["numerics"], cache_hits=runner.extra["cache_hits"],
                          cache_dir=runner.extra["cache_dir"])
        row["runners"][runner_name] = result
    if "eager" in runners:
        for result in row["runners"].values():
            if "median_step_s" in result:
                result["ratio_to_eager"] = result["median_step_s"] / row["runners"]["eager"]["median_step_s"]
    row["memory"] = _peak_memory(device)
    return row


def _peak_memory(device: str) -> dict[str, int | None]:
    if device != "cuda":
        return {}
    import jax
    import torch

    stats = jax.devices()[0].memory_stats() or {}
    return {"torch_peak_bytes": torch.cuda.max_memory_allocated(), "jax_peak_bytes": stats.get("peak_bytes_in_use")}


def probe_compile(name: str, mode_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """torchpar alone: compile the engine and take one step; the compile's phases and the cache's counts."""
    import torch

    from torchpar import compile_cache
    device = _device(args.smoke)
    mode = MODES[mode_name]
    torch.set_float32_matmul_precision(mode.matmul_precision)
    _init_torchpar(args.cache_dir or False)
    model, batch = build((SMOKE_WORKLOADS if args.smoke else WORKLOADS)[name])
    runner = torchpar_runner(model, batch, mode)
    runner.extra["engine"].close()
    return {"device": device, "compile_s": runner.compile_s, "first_step_s": runner.first_step_s,
            "phases": runner.extra["phases"], "cache": compile_cache.counts(), "cache_dir": compile_cache.cache_dir(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


# --- the driver: one child process per (model, mode) ------------------------------------------------------------


def _child(role: str, name: str, mode: str, args: argparse.Namespace, cache_dir: str | None,
           env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``measure`` or ``probe_compile`` in a fresh process; its JSON row (or ``{"error": ...}``)."""
    command = [sys.executable, os.path.abspath(__file__), f"--{role}", f"{name}:{mode}", "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--runners", ",".join(args.runners)]
    command += ["--cache-dir", cache_dir] if cache_dir else []
    command += ["--preset", args.preset] if args.preset else []
    command += ["--smoke"] if args.smoke else []
    # the benchmark decides which cache a child reads (--cache-dir, or none): not a JAX cache of the user's
    environment = {k: v for k, v in {**os.environ, **(env or {})}.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    try:
        result = subprocess.run(command, env=environment, cwd=REPO, capture_output=True, text=True, check=False,
                                timeout=args.child_timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.child_timeout_s:.0f} s (--child-timeout-s)"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        return {"error": f"exit {result.returncode}: " + " | ".join(result.stderr.strip().splitlines()[-3:])[-600:]}
    return json.loads(lines[-1][len("RESULT "):])


def _cache_env(root: str, name: str, mode: str) -> str:
    """A fresh cache directory per (model, mode) for JAX; Inductor's and Triton's go next to it."""
    directory = os.path.join(root, f"{name}-{mode}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(directory, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(directory, "triton")
    return os.path.join(directory, "xla")


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".1f") -> str:
    return "-" if value is None else format(value * scale, spec)


def print_row(row: dict[str, Any]) -> None:
    for runner, result in row.get("runners", {}).items():
        label = f"{row['model']:<9}{row['mode']:<6}{runner:<10}"
        if "error" in result:
            print(f"{label}{result['error']}", flush=True)
            continue
        print(f"{label}{_fmt(result['median_step_s'], 1e3):>10}{_fmt(result['tokens_per_s'], 1, ',.0f'):>12}"
              f"{_fmt(result['mfu'], 100, '.1f'):>7}{_fmt(result.get('ratio_to_eager'), 1, '.2f'):>8}"
              f"{_fmt(result['first_step_s'], 1, '.2f'):>9}", flush=True)


def print_compile(row: dict[str, Any], label: str, result: dict[str, Any]) -> None:
    if "error" in result:
        print(f"{row['model']:<9}{row['mode']:<6}{label:<32}{result['error']}", flush=True)
        return
    phases = result.get("phases", {})
    other = result["compile_s"] - sum(phases.get(k, 0.0) for k in ("capture", "lower", "xla_compile"))
    hits = result.get("cache", {}).get("hits", result.get("cache_hits"))
    print(f"{row['model']:<9}{row['mode']:<6}{label:<32}{_fmt(phases.get('capture'), 1, '.2f'):>9}"
          f"{_fmt(phases.get('lower'), 1, '.2f'):>8}{_fmt(phases.get('xla_compile'), 1, '.2f'):>9}"
          f"{_fmt(other, 1, '.2f'):>8}{_fmt(result['compile_s'], 1, '.2f'):>9}{_fmt(result['first_step_s'], 1, '.2f'):>9}"
          f"{'-' if hits is None else hits:>6}", flush=True)


def run_all(args: argparse.Namespace) -> int:
    root = args.cache_root or tempfile.mkdtemp(prefix="gpu_single-caches-")
    rows = []
    print(f"{'model':<9}{'mode':<6}{'runner':<10}{'step ms':>10}{'tokens/s':>12}{'MFU%':>7}{'×eager':>8}{'first s':>9}")
    try:
        for name in args.models:
            for mode in args.modes:
                cache_dir = _cache_env(root, name, mode)
                row = {"model": name, "mode": mode, **_child("measure", name, mode, args, cache_dir)}
                if "error" in row:
                    print(f"{name:<9}{mode:<6}{row['error']}", flush=True)
                print_row(row)
                rows.append(row)
                write(args, rows, root, quiet=True)  # after every row: a run stopped by a timeout keeps what it measured
                torchpar = row.get("runners", {}).get("torchpar", {})
                if "compile_s" in torchpar:  # it compiled: a fresh process now finds its executables in the cache
                    row["cached_compile"] = _child("probe", name, mode, args, cache_dir)
                if args.profile_compile and "error" not in row:
                    row["compile_profile"] = profile(name, mode, args, on_gpu=row.get("device") == "cuda")
                write(args, rows, root, quiet=True)
    finally:
        if not args.cache_root and not args.keep_caches:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'torchpar compile, seconds':<47}{'capture':>9}{'lower':>8}{'XLA':>9}{'other':>8}{'compile':>9}"
          f"{'1st step':>9}{'hits':>6}")
    for row in rows:
        torchpar = row.get("runners", {}).get("torchpar")
        if torchpar is not None and "error" not in torchpar:
            print_compile(row, "first (cache empty)", torchpar)
        if "cached_compile" in row:
            print_compile(row, "second process (cache warm)", row["cached_compile"])
        for level, result in row.get("compile_profile", {}).items():
            print_compile(row, f"cache off, {level}", result)
    write(args, rows, root)
    return 0


def profile(name: str, mode: str, args: argparse.Namespace, on_gpu: bool) -> dict[str, Any]:
    """torchpar's compile with the cache off, per XLA GPU autotune level (on the CPU: XLA's default flags)."""
    flags = os.environ.get("XLA_FLAGS", "")
    variants = {f"autotune level {level}": f"{flags} --xla_gpu_autotune_level={level}".strip()
                for level in args.autotune_levels} if on_gpu else {"default flags (CPU)": flags}
    return {label: _child("probe", name, mode, args, None, env={"XLA_FLAGS": value, "TORCHPAR_CACHE_DIR": "off"})
            for label, value in variants.items()}


def write(args: argparse.Namespace, rows: list[dict[str, Any]], cache_root: str, quiet: bool = False) -> None:
    """The JSON of the rows so far (rewritten whole each time)."""
    import jax
    import torch

    meta = {"torch": torch.__version__, "jax": jax.__version__, "python": platform.python_version(),
            "host": platform.node(), "cpus": os.cpu_count(), "steps": args.steps, "warmup": args.warmup,
            "smoke": args.smoke, "runners": args.runners, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "cache_root": cache_root if args.cache_root or args.keep_caches else None,
            "flops_formula": "6*N*T + 12*L*d*S*T", "date": time.strftime("%Y-%m-%d")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"meta": meta, "results": rows}, handle, indent=1, default=str)
    if not quiet:
        print(f"wrote {args.out}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama1b", help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--modes", default=None, help="comma-separated: fp32, tf32, bf16 (default all; --smoke: fp32)")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated: eager, compile, torchpar")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (median reported; default 20, smoke 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 5, smoke 1)")
    parser.add_argument("--preset", default=None, help="torchpar.hardware preset for the peaks (default: the GPU's)")
    parser.add_argument("--profile-compile", action="store_true",
                        help="torchpar's compile phases with the cache off, per XLA GPU autotune level")
    parser.add_argument("--autotune-levels", default="0,4", help="--profile-compile on a GPU: xla_gpu_autotune_level")
    parser.add_argument("--smoke", action="store_true", help="tiny configs, 2 steps; runs on the CPU without a GPU")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_single.json; "
                                                    "--smoke: gpu_single_smoke.json in the temp directory)")
    parser.add_argument("--keep-caches", action="store_true", help="keep the temporary compile caches (path in JSON)")
    parser.add_argument("--cache-root", default=None, help="compile caches under this directory, kept (warm runs)")
    parser.add_argument("--child-timeout-s", type=float, default=3600.0)
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # child roles: "model:mode"
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.modes = [m for m in (args.modes or ("fp32" if args.smoke else ",".join(MODES))).split(",") if m]
    args.runners = [r for r in args.runners.split(",") if r]
    args.autotune_levels = [int(level) for level in args.autotune_levels.split(",") if level]
    for kind, given, known in (("model", args.models, WORKLOADS), ("mode", args.modes, MODES),
                               ("runner", args.runners, RUNNERS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"unknown {kind}(s) {unknown}; choose from {', '.join(known)}")
    if any(not 0 <= level <= 4 for level in args.autotune_levels):
        parser.error(f"--autotune-levels are 0..4, got {args.autotune_levels}")
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be ≥ 1 and --warmup ≥ 0")
    args.out = args.out or (os.path.join(tempfile.gettempdir(), "gpu_single_smoke.json") if args.smoke
                            else os.path.join(REPO, "benchmarks", "results", "gpu_single.json"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for role, function in (("measure", measure), ("probe", probe_compile)):
        target = getattr(args, role)
        if target is not None:
            name, mode = target.split(":")
            import transformers

            transformers.logging.set_verbosity_error()
            print("RESULT " + json.dumps(function(name, mode, args), default=str), flush=True)
            return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
