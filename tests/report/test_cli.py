"""``python -m torchpar``: ``plan`` and ``compare`` in fresh processes (which must call ``torchpar.init``
themselves: the test process's XLA_FLAGS are removed), a model file, and user errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from torchpar.__main__ import main
from torchpar.planner.plan import Plan

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "torchpar", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_plan_command(tmp_path):
    result = _run("plan", "--model", "mlp", "--devices", "8", "--method", "shard", "--out", "p.html",
                  "--json", "p.json", "--png", "p.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Plan: ShardParallel (shard), 1 stage(s)")
    assert "layers.0.weight" in result.stdout and "HTML report written to p.html" in result.stdout
    html = (tmp_path / "p.html").read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and html.count("class='device'") + html.count("class='device idle'") == 8
    plan = Plan.from_json((tmp_path / "p.json").read_text())
    assert plan.stages[0].submesh_shape[0] * plan.stages[0].submesh_shape[1] == 8  # the process saw 8 devices
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_command(tmp_path):
    result = _run("compare", "--model", "mlp", "--steps", "3", "--plot", "loss.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("mlp with adamw, 3 steps")
    assert sum(line.split()[0].isdigit() for line in lines[2:]) == 3  # one table row per step
    assert "OK" in lines[-2] and (tmp_path / "loss.png").exists()


def test_plan_from_model_file(tmp_path, capsys):
    """``--model file.py`` with ``build() -> (model, optimizer, batch)``, run in this process (JAX already has
    the session's 8 devices, so the CLI's torchpar.init only declares the cluster)."""
    source = tmp_path / "tiny.py"
    source.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(16, 16)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x).square().mean()\n"
        "def build():\n"
        "    model = Net()\n"
        "    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16)\n")
    out = tmp_path / "tiny.html"
    assert main(["plan", "--model", str(source), "--devices", "8", "--method", "data_parallel", "--out", str(out),
                 "--json", str(tmp_path / "tiny.json")]) == 0
    assert "fc.weight" in capsys.readouterr().out
    assert "fc.bias" in out.read_text(encoding="utf-8")
    assert json.loads((tmp_path / "tiny.json").read_text())["method"] == "data_parallel"


def test_user_errors(tmp_path, capsys):
    assert main(["plan", "--model", "mlp", "--devices", "6", "--hosts", "4", "--out", str(tmp_path / "x.html")]) == 2
    assert "multiple of --hosts" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path / "missing.py"), "--out", str(tmp_path / "x.html")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["plan", "--model", "mlp", "--config", "[1]", "--out", str(tmp_path / "x.html")]) == 2
    assert "JSON object" in capsys.readouterr().err


def test_every_flag_says_what_it_does_and_the_help_shows_examples(capsys):
    import argparse

    import pytest

    from torchpar.__main__ import _parser

    top = _parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, parser in commands.items():
        silent = sorted(action.option_strings[0] for action in parser._actions if action.option_strings and
                        not action.help and action.dest != "help")
        assert not silent, f"`python -m torchpar {name}` flags without help text: {silent}"
    with pytest.raises(SystemExit):
        top.parse_args(["--help"])
    assert "examples:\n  python -m torchpar plan " in capsys.readouterr().out


def test_the_docs_synopsis_names_every_flag_of_each_command():
    """docs/api.md's "Command line" synopsis of ``plan`` and ``compare`` lists every flag their ``--help`` shows."""
    import argparse
    import re

    from torchpar.__main__ import _parser

    docs = (ROOT / "docs" / "api.md").read_text()
    section = docs[docs.index("## Command line"):]
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, parser in commands.items():
        start = section.index(f"`python -m torchpar {name} ")
        synopsis = section[start:section.index("`", start + 1)]
        flags = {option for action in parser._actions for option in action.option_strings
                 if option.startswith("--") and option != "--help"}
        missing = sorted(flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", synopsis))
        assert not missing, f"docs/api.md's `{name}` synopsis lacks {missing}"
