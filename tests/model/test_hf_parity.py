"""The model against HF transformers' DeepseekV3ForCausalLM loading the same checkpoint directory (fp32):
full-prompt logits within 1e-4 of max|logit|, and `pdserve offline`'s greedy tokens equal to HF `generate`."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from pdserve.cli.main import main as cli_main
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.kv_cache import KVCacheLayout, PagedKVCache
from pdserve.model.loader import load_model

transformers = pytest.importorskip("transformers")

PARITY_VARIANTS = ["tiny-fp32", "tiny-bf16", "plain-fp32", "yarn-fp32"]


def load_hf(path):
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0, *torch.randint(3, vocab, (n - 1,), generator=g).tolist()]


@pytest.mark.parametrize("variant", PARITY_VARIANTS)
def test_logits_match_transformers(checkpoint, variant):
    path = checkpoint(variant)
    hf = load_hf(path)
    ours = load_model(path, dtype=torch.float32)
    ids = prompt(ours.args.vocab_size, 77, seed=1)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    page_size = 16
    num_pages = -(-len(ids) // page_size)
    cache = PagedKVCache(
        KVCacheLayout.for_model(ours.args, page_size, torch.float32), num_pages, "cpu"
    )
    batch = build_forward_batch(
        [SeqChunk(ids, 0, list(range(num_pages)))], page_size, "cpu", decode=False, all_logits=True
    )
    got = ours.compute_logits(ours(batch, cache))
    err = (got - expected).abs().max().item()
    assert err <= 1e-4 * expected.abs().max().item(), f"max|dlogit|={err}"


@pytest.mark.parametrize("variant", ["tiny-fp32", "plain-fp32", "yarn-fp32"])
def test_offline_greedy_matches_generate(checkpoint, variant, capsys):
    path = checkpoint(variant)
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None  # generate all 32 tokens, as --ignore-eos does
    ids = prompt(hf.config.vocab_size, 20, seed=2)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    code = cli_main([
        "offline", "--model", str(path), "--prompt-ids", ",".join(map(str, ids)),
        "--max-new-tokens", "32", "--ignore-eos", "--json", "--dtype", "fp32", "--device", "cpu",
    ])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["token_ids"] == expected
    assert isinstance(result["text"], str)
