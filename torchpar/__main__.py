"""The command line: ``python -m torchpar plan ...`` and ``python -m torchpar compare ...``.

    python -m torchpar plan --model gpt2 --config '{"n_layer": 12}' --devices 8 --hosts 2 \\
        --method pipeshard --micro-batches 4 --layers 4 --out plan.html --png plan.png --json plan.json
    python -m torchpar plan --model path/to/model.py --devices 8 --method shard --out plan.html
    python -m torchpar plan --meta --model gpt2 --config '{"n_layer": 48, "n_embd": 8192, "n_head": 64, \\
        "vocab_size": 51200, "n_positions": 1024}' --batch-size 1024 --seq-len 1024 --devices 64 --hosts 8 \\
        --preset v100-16g --memory-gib 24 --method pipeshard --micro-batches 64 --layers 16 --mixed-precision fp16 \\
        --remat auto
    python -m torchpar compare --model llama --optimizer adamw --steps 20 --plot loss.png

``plan`` captures and plans the training step (no XLA compilation, no step), prints ``Plan.summary()`` and
writes the HTML report (and a PNG / the plan's JSON). ``--model`` is a model family of
:mod:`torchpar.harness.zoo` (random weights, tiny default config, ``--config`` overrides) or a Python file whose
``build()`` returns ``(model, optimizer, batch)``; ``--meta`` builds a zoo model and its batch on the meta device
(no weights: GPT-3 39B plans on a laptop; ``docs/tuning_guide.md``). ``compare`` trains a zoo model with PyTorch and
with torchpar side by side (:func:`torchpar.harness.compare.compare_training`) and exits 1 if the losses diverge.

The simulated cluster (``--devices``, ``--hosts``) is set with ``torchpar.init`` before anything imports JAX.
Output is quiet by default; ``-v`` logs INFO, ``-vv`` DEBUG.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from torchpar.methods import CONTEXT_OPTIONS, EXPERTS_OPTIONS, METHOD_NAMES, METHODS, SINGLE_DEVICE, Method
from torchpar.planner.remat import REMAT_CHOICES

if TYPE_CHECKING:
    import torch

OPTIMIZERS = ("adamw", "adam", "sgd")

log = logging.getLogger("torchpar.cli")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        _init_cluster(args)
        return args.run(args)
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError) as error:
        if args.verbose:
            raise
        print(f"torchpar {args.command}: error: {error}", file=sys.stderr)
        return 2


_EXAMPLES = """examples:
  python -m torchpar plan --model gpt2 --devices 8 --method shard --out plan.html
  python -m torchpar plan --meta --model gpt2 --config '{"n_layer": 48, "n_embd": 8192, "n_head": 64}' \\
      --preset v100-16g --hosts 8 --devices 64 --method pipeshard --micro-batches auto --layers 16 \\
      --mixed-precision fp16 --remat auto --batch-size 1024 --seq-len 1024
  python -m torchpar compare --model llama --devices 4 --method data_parallel --steps 20
(python -m torchpar plan --help / compare --help: every option)"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchpar",
        description="torchpar: plan and compare parallel training of PyTorch models on JAX.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EXAMPLES,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="plan a training step and write an HTML report")
    _common_arguments(plan, method="shard", batch_size=8, seq_len=128)
    plan.add_argument("--out", default="plan.html", help="HTML report path")
    plan.add_argument("--png", default=None, help="also write a PNG of the device grid and the timeline")
    plan.add_argument("--json", default=None, help="also write the plan as JSON (Plan.from_json reads it back)")
    plan.add_argument(
        "--meta",
        action="store_true",
        help="build the zoo model and batch on the meta device: no "
        "weights are allocated, so models far larger than this machine's memory can be planned",
    )
    plan.add_argument(
        "--mixed-precision",
        choices=("bf16", "fp16"),
        default=None,
        help="plan the step under torch.autocast in this dtype (fp32 master weights)",
    )
    plan.add_argument(
        "--remat",
        choices=REMAT_CHOICES,
        default="none",
        help="activation checkpointing to price, or 'auto' for the planner to choose",
    )
    plan.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="device memory in GiB (overrides the preset's), the budget every stage must fit",
    )
    plan.add_argument(
        "--profile",
        action="store_true",
        help="measured profiling: time all-reduces and the candidate stages on these devices and keep "
        "the fastest measured plan (cached in TORCHPAR_PROFILE_DIR); not with --meta",
    )
    plan.set_defaults(run=_plan_command)

    compare = commands.add_parser("compare", help="train with PyTorch and torchpar, compare losses")
    _common_arguments(compare, method=SINGLE_DEVICE, batch_size=4, seq_len=32)
    compare.add_argument("--steps", type=int, default=20, help="training steps of each side (default 20)")
    compare.add_argument("--tolerance", type=float, default=1e-4, help="max relative loss difference")
    compare.add_argument("--plot", default=None, help="PNG of both loss curves")
    compare.set_defaults(run=_compare_command)
    return parser


def _common_arguments(parser: argparse.ArgumentParser, *, method: str, batch_size: int, seq_len: int) -> None:
    parser.add_argument(
        "--model",
        default="gpt2",
        help="zoo family (gpt2, llama, bert, vit, resnet, mlp, moe, mixtral) or a "
        "Python file defining build() -> (model, optimizer, batch)",
    )
    parser.add_argument("--config", default="{}", help="JSON config overrides of a zoo model, e.g. '{\"n_layer\": 12}'")
    parser.add_argument("--devices", type=int, default=8, help="number of (fake CPU) devices")
    parser.add_argument("--hosts", type=int, default=1, help="simulated hosts; --devices must be a multiple")
    parser.add_argument(
        "--preset",
        default=None,
        help="price the plan with the constants of real hardware: "
        "h100-nvlink, a100-80g, a100-40g, v100-16g (torchpar.hardware; default: the simulated CPU cluster's)",
    )
    parser.add_argument("--method", choices=METHOD_NAMES, default=method, help=f"parallel method (default {method})")
    parser.add_argument(
        "--mesh",
        default=None,
        help="logical mesh 'd0xd1' for dp/zero2/zero3/megatron/shard "
        "(default: all devices; shard tries every factorization); shard also takes 'dataxd0xd1': "
        "that many data replicas of a d0 x d1 plan",
    )
    parser.add_argument(
        "--micro-batches",
        type=_micro_batches,
        default=4,
        help="pipeshard: micro-batches per step, or 'auto' (the planner tries the counts that divide "
        "the batch and keeps the fastest)",
    )
    parser.add_argument(
        "--experts",
        choices=EXPERTS_OPTIONS,
        default="auto",
        help="shard/pipeshard: MoE grouped matmuls — auto (the ILP decides), split (experts over a "
        "mesh axis), tensor (each expert's hidden dims), replicated",
    )
    parser.add_argument(
        "--context",
        choices=CONTEXT_OPTIONS,
        default="auto",
        help="shard/pipeshard: attention's sequence split — auto (the ILP decides), ring or allgather "
        "(context parallelism wherever the sequence divides), off",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="megatron: reduce-scatter the row-split layers' outputs by tokens (sequence parallelism)",
    )
    parser.add_argument("--layers", type=int, default=4, help="pipeshard: layers formed by operator clustering")
    parser.add_argument("--stages", choices=("auto", "uniform"), default="auto", help="pipeshard: stage option")
    parser.add_argument(
        "--schedule",
        choices=("1f1b", "gpipe", "interleaved_1f1b", "zb_h1"),
        default="1f1b",
        help="pipeshard: schedule (interleaved_1f1b: 2 stages per device group)",
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="zoo models: the optimizer")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3, SGD 0.02)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        help=f"rows of the zoo model's batch: the whole step's, cut into micro-batches and data "
        f"replicas (default {batch_size})",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=seq_len,
        help=f"tokens per row of a zoo language model's batch (default {seq_len})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model's initialization and of the batch's random data (default 0)",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v: INFO logs, -vv: DEBUG")


def _configure_logging(verbose: int) -> None:
    level = logging.WARNING if not verbose else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")


class _CostConstants(TypedDict, total=False):
    """The cost constants the command line sets by hand (``torchpar.init``'s ``**constants``)."""

    device_memory_bytes: int


def _init_cluster(args: argparse.Namespace) -> None:
    """``torchpar.init`` for ``--devices``/``--hosts``; must run before JAX is imported."""
    import torchpar

    if args.devices < 1 or args.hosts < 1 or args.devices % args.hosts:
        raise ValueError(f"--devices {args.devices} must be a positive multiple of --hosts {args.hosts}")
    constants: _CostConstants = {}
    if getattr(args, "memory_gib", None) is not None:
        if not args.memory_gib > 0:
            raise ValueError(f"--memory-gib must be positive, got {args.memory_gib}")
        constants["device_memory_bytes"] = int(args.memory_gib * 2**30)
    if args.hosts > 1:
        torchpar.init(
            cluster="local",
            num_hosts=args.hosts,
            devices_per_host=args.devices // args.hosts,
            preset=args.preset,
            **constants,
        )
    else:
        torchpar.init(cluster="local", num_devices=args.devices, preset=args.preset, **constants)
    try:
        import transformers

        if not args.verbose:
            transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def _method(args: argparse.Namespace) -> Method | None:
    import torchpar

    mesh = _mesh(args.mesh)
    if args.method == "pipeshard":
        if mesh is not None:
            raise ValueError("--mesh applies to one-stage methods; pipeshard picks each stage's mesh")
        return torchpar.PipeshardParallel(
            num_micro_batches=args.micro_batches,
            layer_option=torchpar.AutoLayerOption(layer_num=args.layers),
            stage_option=args.stages,
            schedule=args.schedule,
            experts=args.experts,
            context=args.context,
        )
    if args.method == SINGLE_DEVICE:
        return None
    method_class = METHODS[args.method]
    assert method_class is not None  # single_device alone has no class
    if args.method == "shard":
        return method_class(mesh_shape=mesh, experts=args.experts, context=args.context)
    for flag, value in (("--experts", args.experts), ("--context", args.context)):
        if value != "auto":
            raise ValueError(f"{flag} applies to shard and pipeshard, not {args.method}")
    if args.method == "megatron":
        return method_class(mesh_shape=mesh, sequence_parallel=args.sequence_parallel)
    if args.sequence_parallel:
        raise ValueError(f"--sequence-parallel applies to megatron, not {args.method}")
    return method_class(mesh_shape=mesh)


def _micro_batches(text: str) -> int | str:
    """``--micro-batches``: a positive int or ``auto``."""
    if text == "auto":
        return text
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'auto', got {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'auto', got {count}")
    return count


def _mesh(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) not in (2, 3) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--mesh is 'd0xd1' (e.g. 2x4) or, for shard, 'dataxd0xd1' (e.g. 2x2x2); got {text!r}")
    return tuple(int(p) for p in parts)


def _build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    """``(model, optimizer, batch)`` from a zoo family or from a file's ``build()``."""
    import torch

    torch.manual_seed(args.seed)
    if args.model.endswith(".py"):
        path = Path(args.model)
        if not path.is_file():
            raise FileNotFoundError(f"--model {args.model}: no such file")
        if _config(args):
            raise ValueError(f"--config overrides the config of a zoo model; {path}'s build() makes its own model")
        if getattr(args, "meta", False):
            raise ValueError(
                f"--meta builds a zoo model on the meta device; {path}'s build() can do it itself "
                "(with torch.device('meta'): ...)"
            )
        spec = importlib.util.spec_from_file_location(f"_torchpar_model_{path.stem}", path)
        assert spec is not None and spec.loader is not None  # a .py file: Python's source loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not callable(getattr(module, "build", None)):
            raise ValueError(f"{path} must define build() -> (model, optimizer, batch)")
        built = module.build()
        if not isinstance(built, tuple) or len(built) != 3:
            raise ValueError(f"{path}: build() must return (model, optimizer, batch), got {type(built).__name__}")
        return built
    from torchpar.harness import zoo
    from torchpar.harness.compare import make_optimizer

    if getattr(args, "meta", False):
        with torch.device("meta"):  # parameters, buffers and the random batch without storage
            model, batch = zoo.build(args.model, _config(args), batch_size=args.batch_size, seq_len=args.seq_len)
    else:
        model, batch = zoo.build(args.model, _config(args), batch_size=args.batch_size, seq_len=args.seq_len)
    lr = args.lr if args.lr is not None else (0.02 if args.optimizer == "sgd" else 1e-3)
    return model, make_optimizer(args.optimizer, model.parameters(), lr), batch


def _build_with_progress(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    """:func:`_build` under a progress bar (importing torch and transformers and building the model take seconds)."""
    from torchpar.progress import CompilePhases

    phases = CompilePhases(("build",), f"{args.command}: building {Path(args.model).name}")
    try:
        with phases.phase("importing torch, transformers and the model"):
            return _build(args)
    finally:
        phases.close()


def _config(args: argparse.Namespace) -> dict:
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as error:
        raise ValueError(f"--config is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"--config must be a JSON object, got {args.config!r}")
    from torchpar.harness import zoo

    if args.model in zoo.FAMILIES:
        zoo.check_overrides(args.model, config)  # a misspelled key is an error, not an ignored attribute
    return config


def _plan_command(args: argparse.Namespace) -> int:
    import torchpar

    model, optimizer, batch = _build_with_progress(args)
    method = _method(args)
    log.info("planning %s with %s", args.model, type(method).__name__ if method else "one device")
    if args.profile and args.meta:
        raise ValueError("--profile times the stages on real weights and devices; it cannot run with --meta")
    plan = torchpar.plan(
        model,
        optimizer,
        example_batch=batch,
        method=method,
        mixed_precision=args.mixed_precision,
        remat=args.remat,
        profile=args.profile,
    )
    print(plan.summary())
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    plan.save_html(args.out, param_shapes=shapes, title=f"torchpar plan: {Path(args.model).stem} ({args.method})")
    print(f"HTML report written to {args.out}")
    if args.png:
        plan.save_png(args.png)
        print(f"PNG written to {args.png}")
    if args.json:
        Path(args.json).write_text(plan.to_json(), encoding="utf-8")
        print(f"plan JSON written to {args.json}")
    return 0


def _compare_command(args: argparse.Namespace) -> int:
    from torchpar.harness.compare import compare_training

    if args.model.endswith(".py"):
        raise ValueError("compare takes a zoo model family (it builds the model twice from the same seed)")
    from torchpar.harness.compare import Comparison

    method = _method(args)
    where = type(method).__name__ if method is not None else "one device"
    print(f"{args.model} with {args.optimizer}, {args.steps} steps, torchpar on {where} (compiling first)", flush=True)
    print(Comparison.HEADER, flush=True)
    result = compare_training(
        args.model,
        steps=args.steps,
        optimizer=args.optimizer,
        lr=args.lr,
        method=method,
        overrides=_config(args),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        tolerance=args.tolerance,
        progress=False,
        on_step=lambda *row: print(Comparison.row(*row), flush=True),
    )
    print(result.verdict())
    if args.plot:
        result.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
