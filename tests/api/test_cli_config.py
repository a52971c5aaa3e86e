"""``python -m torchpar plan/compare --config``: a key the model family's config does not have is an error naming
it, the family and the nearest valid keys (it used to become an unused config attribute, silently ignored)."""

from __future__ import annotations

import pytest

from torchpar.__main__ import main
from torchpar.harness import zoo


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_misspelled_config_key_is_an_error_naming_the_nearest_keys(command, capsys, tmp_path):
    argv = [command, "--model", "gpt2", "--config", '{"n_layers": 12}', "--devices", "8"]
    if command == "plan":
        argv += ["--out", str(tmp_path / "plan.html")]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert f"torchpar {command}: error: unknown config key(s) for model family gpt2 (transformers.GPT2Config)" in error
    assert "'n_layers' (nearest valid keys: n_layer" in error
    assert not (tmp_path / "plan.html").exists()


def test_config_keys_of_every_family():
    zoo.check_overrides("gpt2", {"n_layer": 2, "hidden_size": 64, "tie_word_embeddings": True})  # aliases too
    zoo.check_overrides("vit", {"num_labels": 3})  # a property of the config
    zoo.check_overrides("mlp", {"width": 8, "depth": 2})
    with pytest.raises(ValueError, match=r"family llama \(transformers.LlamaConfig\): 'hidden_sise' \(nearest valid "
                                         r"keys: hidden_size"):
        zoo.check_overrides("llama", {"num_hidden_layers": 2, "hidden_sise": 64})
    with pytest.raises(ValueError, match=r"family moe \(MoELayer\): 'expert' \(nearest valid keys: experts"):
        zoo.build("moe", {"expert": 2})


def test_config_with_a_model_file_is_an_error(capsys, tmp_path):
    source = tmp_path / "tiny.py"
    source.write_text("def build():\n    raise AssertionError('not reached')\n")
    assert main(["plan", "--model", str(source), "--config", '{"n_layer": 2}', "--devices", "8"]) == 2
    assert "--config overrides the config of a zoo model" in capsys.readouterr().err


def test_plan_a_mixtral_with_its_experts_split(capsys, tmp_path):
    """``python -m torchpar plan --model mixtral --experts split``: the summary names the expert split and the
    all-to-all bytes; ``--experts`` on a method without the choice is an error."""
    argv = ["plan", "--model", "mixtral", "--devices", "4", "--method", "shard", "--mesh", "1x4", "--experts", "split",
            "--batch-size", "8", "--seq-len", "16", "--out", str(tmp_path / "plan.html")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "experts: 4 grouped matmul(s), experts split over mesh axis 1" in out
    assert "experts: the stage's all-to-alls send" in out
    assert main(["plan", "--model", "mixtral", "--devices", "4", "--method", "data_parallel", "--experts", "split",
                 "--out", str(tmp_path / "dp.html")]) == 2
    assert "--experts applies to shard and pipeshard" in capsys.readouterr().err
