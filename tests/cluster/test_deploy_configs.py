"""Every example serve config under deploy/configs builds a valid ServeConfig (as `pdserve serve --config` reads
it), so a renamed or re-validated field cannot leave an example behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cluster.config import build_config, load_yaml

CONFIGS = sorted((Path(__file__).parents[2] / "deploy" / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_builds(path: Path) -> None:
    config = build_config(load_yaml(path))
    assert config.cluster.num_decode >= 1


def test_full_size_layout_is_dp8_ep8() -> None:
    config = build_config(load_yaml(CONFIGS[0].parent / "hgx-b200-dep8.yaml"))
    assert (config.decode.ranks, config.decode.attention, config.decode.expert_parallel) == (
        8,
        "data",
        8,
    )
