"""Random bits on the CPU in one fused pass (``jaxbackend/threefry_cpu.py``): the unrolled Threefry-2x32 gives
Random123's published known answers, the bits (and dropout masks) of JAX's own rolled lowering — drawn in a process
that does not install it — and the compiled program holds no loop."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbackend import threefry_cpu

# Threefry-2x32, 20 rounds: (key, counter) -> output, from Random123's kat_vectors (also JAX's random tests)
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]

DRAWS = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
{install}
key = jax.random.key(20261129)
out = {{}}
out["bits"] = np.asarray(jax.jit(lambda k: jax.random.bits(jax.random.fold_in(k, 7), (3, 5, 7)))(key)).tolist()
out["mask"] = np.asarray(jax.jit(lambda k: jax.random.bernoulli(k, 0.9, (4, 33)))(key)).tolist()
out["uniform"] = np.asarray(jax.jit(lambda k: jax.random.uniform(jax.random.split(k)[1], (17,)))(key)).tolist()
out["normal16"] = np.asarray(jax.jit(lambda k: jax.random.normal(k, (9,), jnp.bfloat16).astype(jnp.float32))(key)).tolist()
print(json.dumps(out))
"""


def _draws(installed: bool) -> dict:
    install = "from jaxbackend import threefry_cpu; threefry_cpu.install()" if installed else ""
    result = subprocess.run([sys.executable, "-c", DRAWS.format(install=install)], capture_output=True, text=True,
                            timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "", "PYTHONPATH": ":".join(sys.path)})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("key, counter, expected", KNOWN_ANSWERS)
def test_known_answers(key, counter, expected):
    words = [jnp.asarray(np.uint32(v)) for v in (*key, *counter)]
    assert tuple(int(w) for w in jax.jit(threefry_cpu.threefry2x32)(*words)) == expected


def test_the_same_bits_as_jaxs_own_lowering():
    assert _draws(installed=True) == _draws(installed=False)


def test_the_compiled_hash_is_one_pass_without_a_loop():
    threefry_cpu.install()
    step = jax.jit(lambda x, k: jnp.where(jax.random.bernoulli(k, 0.9, x.shape), x / 0.9, 0))
    compiled = step.lower(jnp.ones((64, 1024)), jax.random.key(0)).compile()
    assert "while" not in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < 64 * 1024  # no uint32 words of the whole shape
