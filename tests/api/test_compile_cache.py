"""The persistent compilation cache (``torchpar/compile_cache.py``): real separate processes compile the same
small engine; the first writes the cache, the second loads its step from it (JAX's cache-hit events, not
timings), and with the cache off nothing is written anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchpar import compile_cache
REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, logging, sys
import torch, torchpar
from torchpar import compile_cache
logging.basicConfig(level=logging.WARNING)
logging.getLogger("torchpar.engine.compiled").setLevel(logging.INFO)  # says when the step came from the cache

init_options = json.loads(sys.argv[1])
if init_options is not None:  # None: the README quickstart, which never calls init
    torchpar.init(cluster="local", num_devices=1, **init_options)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
batch = torch.randn(8, 16)
engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                          loss_fn=lambda out, _: out.square().mean())
loss = engine.step(batch).item()
print(json.dumps({"cache_dir": compile_cache.cache_dir(), "counts": compile_cache.counts(), "loss": loss}))
"""


def _run(env_changes: dict[str, str], init_options: dict | None = {}) -> dict:  # noqa: B006 (never mutated)
    """One fresh process compiling and stepping the engine; its cache directory and cache counts."""
    env = {k: v for k, v in os.environ.items() if k not in compile_cache.JAX_VARIABLES + (compile_cache.ENV_VAR,)}
    env.update(env_changes)  # the test session's own JAX cache (tests/conftest.py) is not passed on
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(init_options)], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "stderr": result.stderr}


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.is_file()) if directory.exists() else []


def test_a_second_process_loads_the_step_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    first = _run({compile_cache.ENV_VAR: str(cache)})
    assert first["cache_dir"] == str(cache)
    assert first["counts"]["writes"] >= 1 and first["counts"]["hits"] == 0
    written = _entries(cache)
    assert any(name.startswith("jit_stage") for name in written), written  # the training step itself

    assert "loaded from the compile cache" not in first["stderr"]
    second = _run({compile_cache.ENV_VAR: str(cache)})
    assert second["counts"]["hits"] >= 1, second
    assert f"loaded from the compile cache {cache}" in second["stderr"]  # a cache hit is said
    assert second["loss"] == first["loss"]  # the loaded executable computes what the compiled one did


@pytest.mark.parametrize("how", ["env_off", "init_false"])
def test_with_the_cache_off_nothing_is_written(tmp_path, how):
    xdg = tmp_path / "xdg"  # where the default directory would be
    env = {"XDG_CACHE_HOME": str(xdg)}
    if how == "env_off":
        env[compile_cache.ENV_VAR] = "off"
    out = _run(env, {"compile_cache": False} if how == "init_false" else {})
    assert out["cache_dir"] is None
    assert out["counts"]["hits"] == 0 and out["counts"]["writes"] == 0
    assert _entries(xdg) == []


def test_compile_without_init_caches_in_the_default_directory(tmp_path):
    """The default directory follows ``XDG_CACHE_HOME`` (with ``init()``'s defaults it is the same directory:
    ``test_requested_dir_reads_the_environment``; one process fewer)."""
    xdg = tmp_path / "xdg"
    out = _run({"XDG_CACHE_HOME": str(xdg)}, init_options=None)
    assert out["cache_dir"] == str(xdg / "torchpar" / "xla")
    assert out["counts"]["writes"] >= 1
    assert any(name.startswith("jit_stage") for name in _entries(xdg))


def test_a_cache_set_through_jax_is_kept(tmp_path):
    out = _run({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"), compile_cache.ENV_VAR: str(tmp_path / "ours")},
               {"compile_cache": str(tmp_path / "ours")})
    assert out["cache_dir"] == str(tmp_path / "jax")
    assert _entries(tmp_path / "ours") == []


def test_requested_dir_reads_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    assert compile_cache.requested_dir() == str(tmp_path / "torchpar" / "xla")
    for off in ("off", "OFF", "0", ""):
        monkeypatch.setenv(compile_cache.ENV_VAR, off)
        assert compile_cache.requested_dir() is None
    monkeypatch.setenv(compile_cache.ENV_VAR, "~/elsewhere")
    assert compile_cache.requested_dir() == os.path.expanduser("~/elsewhere")


def test_ray_host_actors_get_the_drivers_cache_settings():
    from torchpar.runtime.ray.host_actor import actor_environment

    env = actor_environment(2)
    assert env["JAX_COMPILATION_CACHE_DIR"] == compile_cache.cache_dir()  # this session's (tests/conftest.py)
    assert float(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) == 0.0


def test_init_rejects_a_compile_cache_that_is_neither_a_flag_nor_a_directory():
    import torchpar

    with pytest.raises(TypeError, match="compile_cache"):
        torchpar.init(cluster="local", num_devices=8, compile_cache=1)
