"""Bad checkpoints give a one-line error naming the tensor, field or file — through the loader and the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.cli.main import main as cli_main
from pdserve.model.errors import CheckpointError, ConfigError
from pdserve.model.loader import load_model

TENSOR = "model.layers.1.self_attn.kv_b_proj.weight"


@pytest.fixture
def broken(checkpoint, tmp_path):
    """A writable copy of the tiny checkpoint and a helper to rewrite the shard holding a tensor."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-fp32"), path)
    index_path = path / "model.safetensors.index.json"

    def rewrite(name, change):
        index = json.loads(index_path.read_text())
        file = index["weight_map"][name]
        tensors = load_file(path / file)
        change(tensors, index)
        save_file(tensors, path / file)
        index_path.write_text(json.dumps(index))
        return file

    return path, rewrite


def cli_error(path, capsys) -> str:
    code = cli_main(
        ["offline", "--model", str(path), "--prompt-ids", "0,5", "--max-new-tokens", "1"]
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_missing_tensor(broken, capsys):
    path, rewrite = broken

    def drop(tensors, index):
        del tensors[TENSOR]
        del index["weight_map"][TENSOR]

    rewrite(TENSOR, drop)
    with pytest.raises(CheckpointError, match=f"missing tensor {TENSOR}"):
        load_model(path)
    assert TENSOR in cli_error(path, capsys)


def test_wrong_shape(broken, capsys):
    path, rewrite = broken

    def reshape(tensors, index):
        tensors[TENSOR] = tensors[TENSOR][:-1].contiguous()

    file = rewrite(TENSOR, reshape)
    with pytest.raises(
        CheckpointError, match=rf"{TENSOR} in {file}: shape \[255, 64\], expected \[256, 64\]"
    ):
        load_model(path)
    assert TENSOR in cli_error(path, capsys)


def test_unexpected_tensor(broken, capsys):
    path, rewrite = broken

    def add(tensors, index):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        index["weight_map"]["model.layers.0.self_attn.rotary_emb.inv_freq"] = index["weight_map"][
            TENSOR
        ]

    file = rewrite(TENSOR, add)
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    with pytest.raises(CheckpointError, match=f"unexpected tensor {name} in {file}"):
        load_model(path)


def test_unsupported_config_value(broken, capsys):
    path, _ = broken
    config = json.loads((path / "config.json").read_text())
    config["scoring_func"] = "softmax"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="scoring_func='softmax'"):
        load_model(path)
    assert "scoring_func" in cli_error(path, capsys)


def test_no_config_json(broken, capsys):
    path, _ = broken
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(path)
    assert "config.json" in cli_error(path, capsys)


def test_truncated_shard(broken, capsys):
    path, _ = broken
    index = json.loads((path / "model.safetensors.index.json").read_text())
    file = index["weight_map"][TENSOR]
    data = (path / file).read_bytes()
    (path / file).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=file):
        load_model(path)
    assert file in cli_error(path, capsys)


def test_missing_shard_file(broken, capsys):
    path, _ = broken
    index = json.loads((path / "model.safetensors.index.json").read_text())
    file = index["weight_map"][TENSOR]
    (path / file).unlink()
    with pytest.raises(CheckpointError, match=f"{file}: shard listed"):
        load_model(path)


def test_absent_mtp_tensors_disable_mtp_with_a_warning(broken, caplog):
    path, _ = broken
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    mtp = [n for n in index["weight_map"] if n.startswith("model.layers.2.")]
    by_file: dict[str, list[str]] = {}
    for name in mtp:
        by_file.setdefault(index["weight_map"].pop(name), []).append(name)
    for file, names in by_file.items():
        tensors = load_file(path / file)
        for name in names:
            del tensors[name]
        save_file(tensors, path / file)
    index_path.write_text(json.dumps(index))
    model = load_model(path)
    assert model.num_mtp == 0
    assert "MTP disabled" in caplog.text
