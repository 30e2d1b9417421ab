"""`pdserve generate` and `pdserve offline` share one sampling default (greedy unless --temperature or
--model-sampling), so one prompt gives one output from both; the tiny model's generation_config.json asks for
temperature 0.6, so a command that took the model's temperature by default would differ."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "pdserve.cli.main"]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120, check=True)


def test_generate_and_offline_give_the_same_output_by_default(server, model_dir):
    prompt = "The quick brown fox"
    offline = run_cli(
        "offline", "--model", str(model_dir), "--prompt", prompt, "--max-new-tokens", "16",
        "--dtype", "fp32", "--ignore-eos", "--json",
    )  # fmt: skip
    served = run_cli(
        "generate", "--addr", server.address, prompt, "--max-tokens", "16", "--ignore-eos", "--json"
    )
    expected = json.loads(offline.stdout)
    assert len(expected["token_ids"]) == 16
    assert json.loads(served.stdout)["token_ids"] == expected["token_ids"]
    assert json.loads(served.stdout)["text"] == expected["text"]


def test_model_sampling_takes_the_models_temperature_in_both(server, model_dir):
    # The same seed samples the same tokens on both paths; at temperature 0.6 over the random tiny model's
    # nearly flat distribution, 16 tokens equal to the greedy ones would be a vanishing chance.
    prompt_ids = "0,5,6,7"
    common = ("--ignore-eos", "--json", "--seed", "3", "--model-sampling")
    offline = run_cli(
        "offline", "--model", str(model_dir), "--prompt-ids", prompt_ids, "--max-new-tokens", "16",
        "--dtype", "fp32", *common,
    )  # fmt: skip
    greedy = run_cli(
        "offline", "--model", str(model_dir), "--prompt-ids", prompt_ids, "--max-new-tokens", "16",
        "--dtype", "fp32", "--ignore-eos", "--json",
    )  # fmt: skip
    served = run_cli(
        "generate", "--addr", server.address, "--prompt-ids", prompt_ids, "--max-tokens", "16",
        *common,
    )  # fmt: skip
    sampled = json.loads(offline.stdout)["token_ids"]
    assert sampled != json.loads(greedy.stdout)["token_ids"]
    assert json.loads(served.stdout)["token_ids"] == sampled


def test_help_states_the_default_in_both():
    for command in ("offline", "generate"):
        text = " ".join(run_cli(command, "--help").stdout.split())
        assert "Greedy (temperature 0) unless --temperature is given" in text, command
        assert "--model-sampling" in text, command
