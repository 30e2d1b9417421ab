"""The fp8 KV cache (`kv_cache_dtype="fp8"`): its layout, its writes and reads as the model makes them, and the
model's logits over it against the same model over a float cache, routing and tokens pinned (a flipped expert
near a tie moves the logits by 10-40%, which says nothing about the cache).

What the fp8 rows lose: the latent in e4m3 (3 mantissa bits, one scale a token). On the tiny fp32 model that moves
the decode steps' logits by 1-2% relative L2 against the fp32 cache; the bound is 5e-2. A prompt run in one piece
reads no cached row, so its logits are those of the float cache exactly."""

from __future__ import annotations

import pytest
import torch
from _pinned import relative_l2, routing, run_logits

from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.mla_decode import dequantize_kv_fp8, fp8_format, quantize_kv_fp8
from pdserve.model.kv_cache import FP8, KVCacheLayout, PagedKVCache, resolve_cache_dtype
from pdserve.model.loader import load_model


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint("tiny-fp32"), dtype=torch.float32)


def test_layout_and_choices(model):
    fp8 = KVCacheLayout.for_model(model.args, 16, resolve_cache_dtype("fp8", model.dtype), 1)
    plain = KVCacheLayout.for_model(model.args, 16, resolve_cache_dtype("auto", model.dtype), 1)
    lora, rope = model.args.kv_lora_rank, model.args.qk_rope_head_dim
    assert fp8.is_fp8 and fp8.storage_dtype == torch.uint8 and not plain.is_fp8
    assert fp8.entry_dim == fp8_format.row_bytes(lora, rope) and plain.entry_dim == lora + rope
    assert fp8.page_bytes == fp8.num_layers * 16 * fp8_format.row_bytes(lora, rope)
    assert plain.page_bytes == plain.num_layers * 16 * (lora + rope) * 4
    assert PagedKVCache(fp8, 3, "cpu").data.dtype == torch.uint8
    # DeepSeek-V3's rows: 656 bytes against 1152 in bf16
    assert KVCacheLayout(61, 64, 512, 64, FP8).page_bytes == 61 * 64 * 656
    assert KVCacheLayout(61, 64, 512, 64, torch.bfloat16).page_bytes == 61 * 64 * 1152
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4'"):
        resolve_cache_dtype("fp4", torch.bfloat16)
    with pytest.raises(ValueError, match="kv_lora_rank a power of two >= 16, the model has 48"):
        KVCacheLayout(2, 16, 48, 16, FP8)


def test_write_then_gather_round_trips_through_the_format():
    """`write` stores each row in the fp8 format in its layer only; `gather` reads the same rows back
    dequantized, as `dequantize_kv_fp8(quantize_kv_fp8(...))` gives them."""
    layout = KVCacheLayout(3, 4, 32, 16, FP8)
    cache = PagedKVCache(layout, 5, "cpu")
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(20, generator=g)[:7]
    c_kv, k_pe = torch.randn(7, 32, generator=g) * 5, torch.randn(7, 16, generator=g)
    cache.write(1, slots, c_kv, k_pe)
    want = dequantize_kv_fp8(quantize_kv_fp8(c_kv, k_pe), 32, 16)
    assert torch.equal(cache.gather(1, slots), want)
    assert (want[:, :32] - c_kv).abs().max() <= c_kv.abs().amax(1, keepdim=True).max() / 16
    assert not cache.data[:, [0, 2]].any()  # the other layers are untouched


def test_decode_over_fp8_rows_stays_close_to_the_float_cache(model):
    g = torch.Generator().manual_seed(3)
    prompt = [0, *torch.randint(3, model.args.vocab_size, (95,), generator=g).tolist()]
    routes: list[torch.Tensor] = []
    with routing("record", routes):
        tokens, expected = run_logits(model, prompt, None, 12)
    with routing("replay", routes):
        _, got = run_logits(model, prompt, tokens, 12, kv_cache_dtype="fp8")
    err = relative_l2(got, expected)
    assert err[0] == 0  # the prompt in one piece reads no cached row
    assert (err[1:] > 0).all() and err.max() <= 5e-2, err


def test_chunked_prefill_reads_the_fp8_prefix(model):
    """A prompt's later pieces attend to its earlier ones through the cache: dequantized fp8 rows."""
    g = torch.Generator().manual_seed(4)
    prompt = [0, *torch.randint(3, model.args.vocab_size, (79,), generator=g).tolist()]
    routes: list[torch.Tensor] = []
    with routing("record", routes):
        tokens, expected = run_logits(model, prompt, None, 2, prefill_chunk=32)
    with routing("replay", routes):
        _, got = run_logits(model, prompt, tokens, 2, kv_cache_dtype="fp8", prefill_chunk=32)
    err = relative_l2(got, expected)
    assert 0 < err[0] <= 5e-2 and err.max() <= 5e-2, err


def test_offline_generator_runs_on_fp8_rows(model):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    out = OfflineGenerator(model, 16, 8, kv_cache_dtype="fp8").generate([0, *range(5, 30)], params)
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="kv_cache_dtype='bf8'"):
        OfflineGenerator(model, kv_cache_dtype="bf8")


def test_cli_names_a_model_the_fp8_rows_do_not_fit(tmp_path, capsys):
    from pdserve.cli.main import main
    from pdserve.model.random_checkpoint import make_checkpoint

    path = make_checkpoint(
        tmp_path / "odd",
        "tiny",
        overrides={"kv_lora_rank": 48},
        shard_bytes=2 << 20,
        progress=False,
    )
    argv = ["offline", "--model", str(path), "--prompt-ids", "0,5", "--kv-cache-dtype", "fp8"]
    assert main(argv) == 2
    assert "kv_lora_rank a power of two >= 16, the model has 48" in capsys.readouterr().err
