"""Serve config: defaults < YAML file < flags; unknown or bad values are refused naming them; every config field
has a `serve` flag whose help is the field's docstring."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdserve.cli.commands import config_from_args
from pdserve.cli.main import _build_parser
from pdserve.cli.main import main as cli_main
from pdserve.cluster.config import SECTIONS, ServeConfig, build_config, section_keys, to_dict
from pdserve.model.errors import ConfigError
from pdserve.model.parallel import WorkerLayout


def parse(argv: list[str]) -> ServeConfig:
    parser, _ = _build_parser(config_flags=True)
    return config_from_args(parser.parse_args(["serve", *argv]))


def test_embedded_default():
    config = parse([])
    assert (config.model.path, config.model.dtype) == ("tiny", "auto")
    assert (config.cluster.num_prefill, config.cluster.num_decode) == (1, 1)
    assert (config.router.host, config.router.port) == ("127.0.0.1", 50051)


def test_file_then_flags(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": "/models/r1", "dtype": "bf16"},
        "cluster": {"num_prefill": 2, "num_decode": 3, "gpus_per_worker": 1},
        "decode": {"max_running": 64, "kv_wait_timeout_s": 30},
    }))  # fmt: skip
    config = parse(["--config", str(path), "--decode", "5", "--decode.max-running", "128",
                    "--prefill.num-pages", "none", "--port", "6000"])  # fmt: skip
    assert config.model == type(config.model)("/models/r1", "bf16", "auto")
    assert (config.cluster.num_prefill, config.cluster.num_decode) == (2, 5)
    assert config.decode.max_running == 128 and config.decode.kv_wait_timeout_s == 30.0
    assert config.prefill.num_pages is None and config.router.port == 6000


@pytest.mark.parametrize(
    "values, message",
    [
        ({"decoder": {}}, "unknown section 'decoder'"),
        ({"decode": {"max_runing": 4}}, "decode.max_runing"),
        ({"decode": {"max_running": "many"}}, "decode.max_running"),
        ({"cluster": {"num_decode": 0}}, "cluster.num_decode=0"),
        ({"prefill": {"page_size": 32}}, "page_size"),
        ({"model": {"dtype": "fp64"}}, "dtype='fp64'"),
        ({"decode": {"ranks": 0}}, "decode.ranks=0"),
        ({"decode": {"ranks": 2, "expert_parallel": 3}}, "decode.expert_parallel=3"),
        ({"prefill": {"attention": "pipeline"}}, "prefill.attention='pipeline'"),
        ({"prefill": {"ranks": 2, "dense": "tensor"}}, "prefill.dense='tensor'"),
        (
            {"decode": {"ranks": 2, "attention": "tensor"}},
            "decode.attention='tensor' with decode.ranks=2 needs",
        ),
        ({"prefill": {"ranks": 2}}, "prefill.attention='data' with prefill.ranks=2"),
        ({"router": {"http_body_timeout_s": 0}}, "http_body_timeout_s=0"),
        ({"router": {"grpc_keepalive_s": -1}}, "grpc_keepalive_s=-1"),
    ],
)
def test_bad_values_name_the_field(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(values)


def test_layout_flags():
    config = build_config(
        overrides={"cluster": {"num_prefill": 0},
                   "decode": {"ranks": 2, "attention": "data", "expert_parallel": 2},
                   "prefill": {"ranks": 2, "attention": "tensor", "dense": "tensor"}}
    )  # fmt: skip
    assert config.decode.layout == WorkerLayout(2, "data", 2)
    assert config.prefill.layout == WorkerLayout(2, "tensor", 1, "tensor")
    assert ServeConfig().decode.layout == ServeConfig().prefill.layout == WorkerLayout()
    # the layout is nested in the code and flat in the sections users write and see
    decode = to_dict(config)["decode"]
    assert (decode["ranks"], decode["attention"], decode["expert_parallel"]) == (2, "data", 2)
    assert "layout" not in decode


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError, match="--decode.max-running"):
        parse(["--decode.max-running", "lots"])


def test_every_field_is_documented_and_has_a_flag():
    parser, _ = _build_parser(config_flags=True)
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {s for a in serve._actions for s in a.option_strings}
    for section, cls in SECTIONS.items():
        for name, key in section_keys(cls).items():
            assert key.doc, f"{section}.{name} has no docstring"
            assert f"--{section}.{name.replace('_', '-')}" in flags
    layout_keys = {"ranks", "attention", "expert_parallel", "dense"}
    assert layout_keys <= set(section_keys(SECTIONS["decode"]))


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).parents[2] / "deploy" / "configs").glob("*.yaml")),
    ids=lambda p: p.name,
)
def test_deploy_configs_load(path):
    config = parse(["--config", str(path)])
    assert config.cluster.num_decode >= 1


def test_print_config_round_trips(tmp_path, capsys):
    # the command's own entry point, in this process (a `python -m pdserve.cli.main` start is the other CLI tests')
    assert cli_main(["serve", "--decode", "2", "--print-config"]) == 0
    path = tmp_path / "printed.yaml"
    path.write_text(capsys.readouterr().out)
    assert parse(["--config", str(path)]) == parse(["--decode", "2"])
