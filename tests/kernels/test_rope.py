"""Triton interleaved RoPE (in place) against the torch reference.

q_pe is passed as the model passes it: the non-contiguous rope slice of q ([T, H, nope + rope]
split on the last dim), and the test checks the nope part is left untouched. Tolerance: 1 unit in
the last place of the dtype, relative (the GPU may fuse a multiply-add that the reference rounds
twice); the CPU interpreter matches exactly in fp32. CPU cases are fp32 / fp16 (the interpreter
truncates fp32 -> bf16 casts); bf16 at DeepSeek-V3 sizes runs on the GPU."""

from __future__ import annotations

import pytest
import torch
from _decode_check import DEVICE, exact_fp8_rows

from pdserve.kernels.rope import ref
from pdserve.kernels.rope import triton as tri

ULP = {torch.float32: 2.0**-22, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}

CASES = [
    # tokens, heads, nope dims, rope dims, dtype, k_pe as [T, 1, R]
    pytest.param(5, 3, 8, 16, torch.float32, False, id="5x3-f32"),
    pytest.param(1, 1, 0, 64, torch.float16, True, id="1x1-f16-k3d"),
    pytest.param(9, 17, 16, 32, torch.float16, False, id="9x17-f16"),
    pytest.param(
        256, 128, 128, 64, torch.bfloat16, False, marks=pytest.mark.gpu, id="256x128-bf16"
    ),
    pytest.param(33, 16, 128, 64, torch.bfloat16, True, marks=pytest.mark.gpu, id="33x16-bf16"),
]


@pytest.mark.parametrize("tokens,heads,nope,rope_dim,dtype,k_3d", CASES)
def test_rope_matches_ref(tokens, heads, nope, rope_dim, dtype, k_3d) -> None:
    torch.manual_seed(tokens * heads + rope_dim)
    max_pos = 4096
    q = torch.randn(tokens, heads, nope + rope_dim, device=DEVICE).to(dtype)
    k_pe = torch.randn(tokens, 1, rope_dim, device=DEVICE).to(dtype)
    if not k_3d:
        k_pe = k_pe[:, 0]
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE, dtype=torch.int64)
    angles = torch.rand(max_pos, rope_dim // 2, device=DEVICE) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1) * 1.3  # an attention factor
    q_ref, k_ref = q.clone(), k_pe.clone()
    ref.rope(q_ref.split([nope, rope_dim], -1)[1], k_ref, positions, cos_sin)
    q_pe = q.split([nope, rope_dim], -1)[1]
    assert not q_pe.is_contiguous() or nope == 0
    tri.rope(q_pe, k_pe, positions.int(), cos_sin)
    tol = ULP[dtype]
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(k_pe.float(), k_ref.float(), rtol=tol, atol=tol)
    assert torch.equal(q[..., :nope], q_ref[..., :nope])


@pytest.mark.parametrize("tokens,heads,nope,rope_dim,dtype,k_3d", CASES)
def test_rope_into_q_out(tokens, heads, nope, rope_dim, dtype, k_3d) -> None:
    """q_out=: rotated q_pe lands in the rope columns of a wider buffer (as the absorbed decode query
    takes it), q_pe and the buffer's other columns keep their values; k_pe still rotates in place. The
    same values as in place, in both implementations."""
    torch.manual_seed(tokens + heads + rope_dim)
    q = torch.randn(tokens, heads, nope + rope_dim, device=DEVICE).to(dtype)
    k_pe = torch.randn(tokens, 1, rope_dim, device=DEVICE).to(dtype)
    k_pe = k_pe if k_3d else k_pe[:, 0]
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    angles = torch.rand(64, rope_dim // 2, device=DEVICE) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    q_in, k_in = q.clone(), k_pe.clone()
    ref.rope(q_in.split([nope, rope_dim], -1)[1], k_in, positions, cos_sin)  # in place: the values
    for impl in (tri, ref):
        q_pe, k = q.split([nope, rope_dim], -1)[1].clone(), k_pe.clone()
        buf = torch.randn(tokens, heads, 5 + rope_dim, device=DEVICE).to(dtype)
        head = buf[..., :5].clone()
        impl.rope(q_pe, k, positions, cos_sin, q_out=buf[..., 5:])
        assert torch.equal(q_pe, q.split([nope, rope_dim], -1)[1])
        assert torch.equal(buf[..., :5], head)
        tol = ULP[dtype]
        torch.testing.assert_close(
            buf[..., 5:].float(), q_in[..., nope:].float(), rtol=tol, atol=tol
        )
        torch.testing.assert_close(k.float(), k_in.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "tokens,heads,lora,rope_dim,page_size,dtype",
    [
        pytest.param(6, 3, 32, 16, 4, torch.float32, id="6x3-f32"),
        pytest.param(9, 17, 48, 32, 16, torch.float16, id="9x17-odd-lora-f16"),
        pytest.param(64, 128, 512, 64, 64, torch.bfloat16, marks=pytest.mark.gpu, id="v3-bf16"),
    ],
)
def test_rope_writes_the_cache(tokens, heads, lora, rope_dim, page_size, dtype) -> None:
    """cache=: k_pe's rotation goes into the cache rows with c_kv (k_pe left as it was), into one layer
    of a page-major cache from strided views, as the decode step calls it; q_pe into q_out. Triton
    against the reference: q and the rope part within an ulp, c_kv bit for bit, other rows untouched."""
    g = torch.Generator().manual_seed(tokens + heads)
    q = torch.randn(tokens, heads, 8 + rope_dim, generator=g).to(dtype).to(DEVICE)
    kv = torch.randn(tokens, lora + rope_dim + 3, generator=g).to(dtype).to(DEVICE)
    c_kv, k_pe = kv[:, :lora], kv[:, lora : lora + rope_dim]
    positions = torch.randint(0, 64, (tokens,), generator=g).to(DEVICE)
    angles = torch.rand(64, rope_dim // 2, generator=g).to(DEVICE) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    pages = -(-2 * tokens // page_size)
    slots = torch.randperm(pages * page_size, generator=g)[:tokens].to(DEVICE)
    data = torch.randn(pages, 3, page_size, lora + rope_dim, generator=g).to(dtype).to(DEVICE)
    results = []
    for impl in (ref, tri):
        cache, q_out = (
            data.clone(),
            torch.empty(tokens, heads, rope_dim, device=DEVICE, dtype=dtype),
        )
        k_before = k_pe.clone()
        impl.rope(
            q[..., 8:], k_pe, positions, cos_sin, q_out=q_out, cache=(cache[:, 1], slots, c_kv)
        )
        assert torch.equal(k_pe, k_before)
        results.append((cache, q_out))
    (want, want_q), (got, got_q) = results
    tol = ULP[dtype]
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    rows = got[:, 1].reshape(-1, lora + rope_dim)[slots]
    assert torch.equal(rows[:, :lora], c_kv)
    written = torch.zeros(pages * page_size, dtype=torch.bool, device=DEVICE)
    written[slots] = True
    untouched = torch.ones(pages, 3, page_size, dtype=torch.bool, device=DEVICE)
    untouched[:, 1] = ~written.view(pages, page_size)
    assert torch.equal(got[untouched], data[untouched])


def test_rope_rejects_bad_inputs() -> None:
    q = torch.randn(3, 2, 16, device=DEVICE)
    k = torch.randn(3, 16, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cs = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="k_pe"):
        tri.rope(q, torch.randn(3, 8, device=DEVICE), pos, cs)
    with pytest.raises(ValueError, match="positions"):
        tri.rope(q, k, pos.float(), cs)
    with pytest.raises(ValueError, match="cos_sin"):
        tri.rope(q, k, pos, cs.double())
    with pytest.raises(ValueError, match="rope: cache rows of 40"):
        cache = (torch.zeros(2, 4, 40, device=DEVICE), pos, torch.zeros(3, 32, device=DEVICE))
        tri.rope(q, k, pos, cs, cache=cache)
    with pytest.raises(ValueError, match="rope: slots must be int"):
        cache = (
            torch.zeros(2, 4, 48, device=DEVICE),
            pos.float(),
            torch.zeros(3, 32, device=DEVICE),
        )
        tri.rope(q, k, pos, cs, cache=cache)
    with pytest.raises(ValueError, match="q_out must be"):
        tri.rope(q, k, pos, cs, q_out=torch.empty(3, 2, 8, device=DEVICE))


@pytest.mark.parametrize(
    "tokens,heads,lora,rope_dim,page_size,dtype",
    [
        pytest.param(6, 3, 32, 16, 4, torch.float32, id="6x3-f32"),
        pytest.param(9, 17, 64, 16, 16, torch.float16, id="9x17-f16"),
        pytest.param(64, 128, 512, 64, 64, torch.bfloat16, marks=pytest.mark.gpu, id="v3-bf16"),
    ],
)
@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_rope_writes_an_fp8_cache(backend, tokens, heads, lora, rope_dim, page_size, dtype) -> None:
    """cache= with an fp8 cache (uint8 rows), through the dispatcher as the decode step calls it: each
    token's row is the fp8 format of [c_kv | rotated k_pe] (the latent and its scale bit for bit, the
    rope part within a bf16 ulp), k_pe is left as it was, q_pe goes into q_out, other rows untouched."""
    from pdserve.kernels import use_backend
    from pdserve.kernels.mla_decode import fp8_format, quantize_kv_fp8
    from pdserve.kernels.rope import rope

    g = torch.Generator().manual_seed(tokens + heads)
    q = torch.randn(tokens, heads, 8 + rope_dim, generator=g).to(dtype).to(DEVICE)
    kv = torch.randn(tokens, lora + rope_dim + 3, generator=g).to(dtype).to(DEVICE)
    if DEVICE == "cpu":  # the interpreter's fp8 casts are inexact: a latent that quantizes exactly
        kv[:, :lora] = exact_fp8_rows(tokens, lora, rope_dim, seed=tokens)[0].to(dtype)
    c_kv, k_pe = kv[:, :lora], kv[:, lora : lora + rope_dim]
    positions = torch.randint(0, 64, (tokens,), generator=g).to(DEVICE)
    angles = torch.rand(64, rope_dim // 2, generator=g).to(DEVICE) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    pages, width = -(-2 * tokens // page_size), fp8_format.row_bytes(lora, rope_dim)
    slots = torch.randperm(pages * page_size, generator=g)[:tokens].to(DEVICE)
    data = torch.randint(0, 256, (pages, 3, page_size, width), generator=g, dtype=torch.uint8)
    cache, q_out = data.to(DEVICE), torch.empty(tokens, heads, rope_dim, device=DEVICE, dtype=dtype)
    k_before = k_pe.clone()
    with use_backend(backend):
        rope(q[..., 8:], k_pe, positions, cos_sin, q_out=q_out, cache=(cache[:, 1], slots, c_kv))
    assert torch.equal(k_pe, k_before)
    want_q, want_k = q[..., 8:].clone(), k_pe.clone()
    ref.rope(want_q, want_k, positions, cos_sin)
    tol = ULP[dtype]
    torch.testing.assert_close(q_out.float(), want_q.float(), rtol=tol, atol=tol)
    want = quantize_kv_fp8(c_kv, want_k)
    rows = cache[:, 1].reshape(-1, width)[slots]
    rope_at, scale_at = fp8_format.rope_offset(lora), fp8_format.scale_offset(lora, rope_dim)
    assert torch.equal(rows[:, :rope_at], want[:, :rope_at])
    assert torch.equal(rows[:, scale_at : scale_at + 4], want[:, scale_at : scale_at + 4])
    got_pe = rows[:, rope_at:scale_at].contiguous().view(torch.bfloat16).float()
    want_pe = want[:, rope_at:scale_at].contiguous().view(torch.bfloat16).float()
    torch.testing.assert_close(got_pe, want_pe, rtol=ULP[torch.bfloat16], atol=ULP[torch.bfloat16])
    written = torch.zeros(pages * page_size, dtype=torch.bool, device=DEVICE)
    written[slots] = True
    untouched = torch.ones(pages, 3, page_size, dtype=torch.bool, device=DEVICE)
    untouched[:, 1] = ~written.view(pages, page_size)
    assert torch.equal(cache[untouched].cpu(), data[untouched.cpu()])
