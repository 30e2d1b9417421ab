"""`pdserve serve --model.load-format dummy` on a directory of config.json and tokenizer alone (`make-checkpoint
--config-only`): the workers make their weights on their device from the config, the same weights the random
checkpoint of the same seed holds, so the service streams that checkpoint's offline greedy tokens; and the
offline command's `--load-format dummy` likewise."""

from __future__ import annotations

import json

import pytest
from serving import collect, greedy, start_server, workload

from pdserve.cli.client import Client
from pdserve.model.random_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    out = make_checkpoint(
        tmp_path_factory.mktemp("ck") / "tiny-config", "tiny", dtype="fp32", weights=False
    )
    assert not list(out.glob("*.safetensors"))
    return out


def test_serve_with_dummy_weights_streams_the_checkpoint_tokens(
    ray_cluster, config_only, reference
):
    cases = workload(4, seed=11, max_len=60)
    with (
        start_server(
            config_only, model={"load_format": "dummy"}, cluster={"num_prefill": 0}
        ) as server,
        Client(server.address) as client,
    ):
        for i, (prompt, max_tokens) in enumerate(cases):
            chunks = collect(client, greedy(prompt, max_tokens, request_id=f"dummy-{i}"))
            got = [t for c in chunks for t in c.token_ids]
            assert got == reference(prompt, max_tokens), i


def test_offline_with_dummy_weights_equals_the_checkpoint(config_only, model_dir, capsys):
    from pdserve.cli.main import main

    def run(path, *extra):
        argv = ["offline", "--model", str(path), "--prompt-ids", "0,5,9,200", "--max-new-tokens", "6",
                "--temperature", "0", "--ignore-eos", "--json", *extra]  # fmt: skip
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    assert run(config_only, "--load-format", "dummy") == run(model_dir)
