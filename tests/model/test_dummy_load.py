"""`load_format="dummy"`: random weights from config.json alone, equal to the weights `make_checkpoint` writes for
the same seed (fp32 and fp8 with scales), giving finite logits; an unknown format is refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from _parallel_ranks import run_steps
from test_parallel import NUM_PAGES, make_requests

from pdserve.model.errors import ConfigError
from pdserve.model.loader import load_model


@pytest.mark.parametrize("variant", ["tiny-fp32", "tiny-fp8"])
def test_dummy_equals_random_checkpoint_of_same_seed(variant, checkpoint, tmp_path):
    ckpt = checkpoint(variant)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(ckpt / "config.json", config_only / "config.json")
    loaded = load_model(ckpt, progress=False)
    dummy = load_model(config_only, load_format="dummy", seed=0)
    other_seed = load_model(config_only, load_format="dummy", seed=1)
    loaded_params = dict(loaded.named_parameters())
    for name, p in dummy.named_parameters():
        assert p.dtype == loaded_params[name].dtype, name
        assert torch.equal(p, loaded_params[name]), name
    assert not torch.equal(other_seed.layers[0].attn.wo.weight, dummy.layers[0].attn.wo.weight)
    if variant == "tiny-fp8":
        assert dummy.layers[1].ffn.experts.w13.dtype == torch.float8_e4m3fn
    requests = make_requests(dummy.args.vocab_size)
    logits = run_steps(dummy, requests, NUM_PAGES)
    assert all(torch.isfinite(t).all() for step in logits.values() for t in step.values())


def test_unknown_load_format_is_refused(checkpoint):
    with pytest.raises(ConfigError, match="load_format='pt'"):
        load_model(checkpoint("tiny-fp32"), load_format="pt")  # type: ignore[arg-type]
