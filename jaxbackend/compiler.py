"""XLA compiler options torchpar passes to every compilation.

On the CPU backend YNNPACK library fusions of dots and reductions make a training step markedly faster
(``benchmarks/xla_cpu_notes.md``: the largest single lever, and compilation about twice as fast). Its
elementwise fusions (``LIBRARY_FUSION_TYPE_ELTWISE``) were on until 2026-11-26 and are off since: they split
each optimizer update into several fusions and materialize every scalar hyper-parameter broadcast to the
parameter's shape once parameters share a shape (every repeated layer) — three AdamW updates of
``[8, 1024, 256]`` took 52 ms with them and 17 ms without; whole steps, interleaved in one process on 2 cores:
GPT-2 4×256 315 → 287 ms (eager 308), a Llama 2×256 276 → 275 ms, Mixtral 2×256 with 32 experts 624 →
585 ms. oneDNN matmul fusion (``xla_cpu_use_onednn`` + ``LIBRARY_FUSION_TYPE_DOT``) would add a few
percent but fails to compile HF Llama ("partition compile failed", which aborts the process) in
jaxlib 0.10.2, so it is left off. Other backends get no extra options.
"""

from __future__ import annotations

import jax
import jax.stages

CPU_LIBRARY_FUSIONS: dict[str, str | bool] = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE",
}


def compiler_options(library_fusions: bool = True, num_devices: int = 1) -> dict[str, str | bool]:
    """Options for ``jit(..., compiler_options=...)`` / ``lowered.compile(compiler_options=...)`` of an
    executable running on ``num_devices`` devices.

    The CPU library fusions are used for single-device executables only (multi-device SPMD programs on
    fake CPU devices keep XLA's defaults: they are what the sharding tests check collectives on).
    """
    if library_fusions and num_devices == 1 and jax.default_backend() == "cpu":
        return dict(CPU_LIBRARY_FUSIONS)
    return {}


MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")


def memory_analysis(compiled: jax.stages.Compiled) -> dict[str, int]:
    """XLA's per-device memory analysis of a compiled executable: ``{argument,output,alias,temp,
    generated_code}_bytes``."""
    analysis = compiled.memory_analysis()
    return {f"{field}_bytes": int(getattr(analysis, f"{field}_size_in_bytes", 0) or 0) for field in MEMORY_FIELDS}
