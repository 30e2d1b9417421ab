"""Every example serve config under deploy/configs builds a valid ServeConfig (as `pdserve serve --config` reads
it), so a renamed or re-validated field cannot leave an example behind; and every worker of several ranks in them
is sized by the `pdserve plan` command its header quotes: the command's layout is the worker's, the plan fits,
and the header's figures (weights and KV tokens per rank) are the plan's own. The `ray up` YAMLs' `ray start`
commands parse with Ray's own CLI and give each node its GPUs and, on an NVL72 rack, its NVLink-domain label."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import yaml

from pdserve.cli.plan import add_plan_command, layout_from_args, plan_from_args
from pdserve.cluster.config import ServeConfig, build_config, load_yaml
from pdserve.cluster.placement import NVLINK_DOMAIN_LABEL
from pdserve.cluster.ray_connect import is_loopback
from pdserve.model.parallel import WorkerLayout

CONFIGS = sorted((Path(__file__).parents[2] / "deploy" / "configs").glob("*.yaml"))
PLAN_LINE = re.compile(
    r"^#\s+(?P<role>prefill|decode): (?P<command>pdserve plan .+)\n"
    r"#\s+fits: (?P<weights_gib>[\d.]+) GiB of weights per rank, (?P<kv_tokens>\d+) KV tokens per rank"
    r"(?: \((?P<worker_tokens>\d+) per worker\))?",
    re.MULTILINE,
)


def _config(name: str) -> ServeConfig:
    return build_config(load_yaml(CONFIGS[0].parent / name))


def _workers_of_several_ranks(config: ServeConfig) -> dict[str, object]:
    """Role -> role config, for each role that runs workers of several ranks."""
    roles = {"prefill": config.prefill, "decode": config.decode}
    if config.cluster.num_prefill == 0:
        del roles["prefill"]
    return {role: worker for role, worker in roles.items() if worker.layout.ranks > 1}


def _plan_args(command: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_plan_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(shlex.split(command)[1:])


def _gpus(config: ServeConfig) -> int:
    c = config.cluster
    return c.num_prefill * config.prefill.layout.ranks + c.num_decode * config.decode.layout.ranks


def test_there_are_configs() -> None:
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_builds(path: Path) -> None:
    config = build_config(load_yaml(path))
    assert config.cluster.num_decode >= 1


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_config_that_listens_beyond_loopback_has_its_keys(path: Path) -> None:
    """`pdserve serve` refuses a non-loopback host with no API key: each such example names its key files
    (which the `ray up` YAMLs mount), and an admin key, without which an API key refuses `pdserve status`."""
    config = build_config(load_yaml(path))
    if is_loopback(config.router.host):
        return
    security = config.security
    assert not security.insecure, path.name
    assert security.api_key_file and security.admin_key_file, path.name
    for yaml_path in sorted(CONFIGS[0].parents[1].glob("ray/*.yaml")):
        mounts = yaml.safe_load(yaml_path.read_text())["file_mounts"]
        folder = str(Path(security.api_key_file).parent)
        assert mounts.get(folder) == folder, f"{yaml_path.name} does not mount {folder}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_workers_of_several_ranks_are_sized_by_pdserve_plan(path: Path) -> None:
    config = build_config(load_yaml(path))
    plans = {m["role"]: m for m in PLAN_LINE.finditer(path.read_text())}
    workers = _workers_of_several_ranks(config)
    assert sorted(plans) == sorted(workers), f"{path.name}: plan lines {sorted(plans)}"
    for role, worker in workers.items():
        line = plans[role]
        args = _plan_args(line["command"])
        assert args.command == "plan"
        assert layout_from_args(args) == worker.layout, role
        assert args.page_size == worker.page_size, role
        assert args.max_num_batched_tokens == worker.max_num_batched_tokens, role
        assert args.kv_cache_dtype == config.model.kv_cache_dtype, role
        if role == "decode":
            assert args.max_running == worker.max_running, role
        plan = plan_from_args(args)
        plan.check()
        assert f"{plan.total_weight_bytes / 2**30:.2f}" == line["weights_gib"], role
        assert plan.kv_tokens == int(line["kv_tokens"]), role
        if line["worker_tokens"] is not None:
            assert plan.worker_tokens == int(line["worker_tokens"]), role


def test_full_size_layouts() -> None:
    dep8 = _config("hgx-b200-dep8.yaml")
    assert dep8.decode.layout == WorkerLayout(8, "data", 8)
    assert (dep8.cluster.num_prefill, _gpus(dep8)) == (0, 8)

    two_nodes = _config("hgx-b200x2-1p1d.yaml")
    prefill, decode = two_nodes.prefill, two_nodes.decode
    assert prefill.layout == WorkerLayout(8, "tensor", 8, "tensor")
    assert decode.layout == WorkerLayout(8, "data", 8)
    assert (two_nodes.cluster.rank_span, _gpus(two_nodes)) == ("node", 16)

    rack = _config("gb200-nvl72.yaml")
    assert rack.prefill.layout == WorkerLayout(8, "tensor", 8, "tensor")
    assert rack.decode.layout == WorkerLayout(16, "data", 16)
    # a worker spans trays of 4 GPUs, so only within the rack's NVLink domain
    assert (rack.cluster.rank_span, _gpus(rack)) == ("nvlink_domain", 72)


def test_no_full_size_worker_fits_half_a_b200_node() -> None:
    """Why no HGX B200 config splits one node into P and D: no worker of 4 GPUs holds DeepSeek-V3's weights."""
    for layout in ("", " --attention tp --dense tp"):
        plan = plan_from_args(
            _plan_args(f"pdserve plan --preset v3-shape --gpus 4 --gpu-memory-gib 180{layout}")
        )
        assert not plan.fits and "weights" in plan.shortfall


RAY_YAMLS = Path(__file__).parents[2] / "deploy" / "ray"


def _ray_starts(name: str) -> list[dict]:
    """The options of every `ray start` in a `ray up` YAML's start commands, as Ray's own CLI parses them."""
    from ray._private.label_utils import parse_node_labels_string
    from ray.scripts.scripts import start

    spec = yaml.safe_load((RAY_YAMLS / name).read_text())
    starts = []
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for command in spec[key]:
            for part in command.split(";"):
                words = shlex.split(part)
                if words[:2] == ["ray", "start"]:
                    params = start.make_context("start", words[2:]).params
                    params["labels"] = parse_node_labels_string(params["labels"] or "")
                    starts.append(params)
    return starts


# Ray's CLI module imports Ray Serve, whose pydantic models warn of deprecations that are Ray's to fix
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_ray_yamls_offer_each_node_s_gpus_and_label_nvl72_trays() -> None:
    trays = _ray_starts("gb200-nvl72.yaml")
    assert len(trays) == 2 and trays[0]["head"] and not trays[1]["head"]
    for tray in trays:
        assert tray["num_gpus"] == 4
        assert set(tray["labels"]) == {NVLINK_DOMAIN_LABEL}
    assert trays[0]["labels"] == trays[1]["labels"]  # one rack, one domain
    spec = yaml.safe_load((RAY_YAMLS / "gb200-nvl72.yaml").read_text())
    num_trays = 1 + len(spec["provider"]["worker_ips"])
    assert num_trays == 18
    assert _gpus(_config("gb200-nvl72.yaml")) == num_trays * 4  # the rack config fills every tray

    nodes = _ray_starts("hgx-b200.yaml")
    assert [n["num_gpus"] for n in nodes] == [8, 8]
    spec = yaml.safe_load((RAY_YAMLS / "hgx-b200.yaml").read_text())
    assert 1 + len(spec["provider"]["worker_ips"]) >= _gpus(_config("hgx-b200x2-1p1d.yaml")) // 8


def test_ray_yamls_start_ray_with_token_authentication() -> None:
    """Every `ray start` runs with RAY_AUTH_MODE=token, every node gets the token, and `pdserve` (run through
    `ray exec`) finds the mode in its shell."""
    for path in sorted(RAY_YAMLS.glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        commands = spec["head_start_ray_commands"] + spec["worker_start_ray_commands"]
        starts = [c for c in commands if "ray start" in c]
        assert starts, path.name
        for command in starts:
            before = command[: command.index("ray start")]
            assert "export RAY_AUTH_MODE=token;" in before, (path.name, command)
        assert spec["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token", path.name
        assert any("export RAY_AUTH_MODE=token" in c for c in spec["setup_commands"]), path.name
