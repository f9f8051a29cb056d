"""epd's CPU kernels (``kernels/csrc``, ``epd.kernels.cpu_extension``) against their torch references.

* ``linear``: fp32 within 1e-5 of ``F.linear`` (in fp64); bf16 within bf16 rounding of the
  fp32 product of the same bf16 inputs; int8 weights within the int16 rounding of x (half a
  step of each row's scale times the row's sum of |w|) of ``F.linear`` on the
  ``dequantize_int8`` weights. M runs over 1..20 rows (the 4-row tiles and a partial last
  tile), K over 33, 100, 576 (odd K: the last k pair half padding), N over 7 and 130 (partial
  16-column blocks and 4-block panels), with and without bias; weights packed by
  ``pack_linear_weight``.
* the element-wise kernels against the eager modules of ``epd.layers`` (``RMSNorm``,
  ``RotaryEmbedding``, ``SiluAndMul``): fp32 within 1e-6, bf16 equal or 1 ulp apart;
  ``store_kv`` against ``store_kvcache_ref``;
* bad arguments raise RuntimeError with a message (TORCH_CHECK), never write out of bounds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epd.kernels.cpu_extension import load
from epd.kernels.linear import PackedWeight, dequantize_int8, linear, pack_weight, quantize_int8
from epd.kernels.store_kv import store_kvcache_ref
from epd.layers.activation import SiluAndMul
from epd.layers.layernorm import RMSNorm
from epd.layers.rotary import RotaryEmbedding

ext = load()


def lin(x, w, b=None, s=None):
    """``ext.linear`` on ``w`` [N, K] packed by ``ext.pack_linear_weight``."""
    return ext.linear(x, ext.pack_linear_weight(w), w.shape[0], b, s)


pytestmark = pytest.mark.skipif(ext is None, reason="epd's CPU kernels are not built here")

ROWS = range(1, 21)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |t| (8 significant bits), elementwise, as fp32."""
    a = t.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def assert_within_ulp(got: torch.Tensor, want: torch.Tensor, ulps: float = 1.0) -> None:
    """bf16 ``got`` equals ``want`` or is at most ``ulps`` bf16 ulps away (at the larger of the two)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    tol = ulps * bf16_ulp(torch.maximum(got.float().abs(), want.float().abs()))
    bad = diff > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements more than {ulps} ulp apart, e.g. "
                           f"got {got[bad][:4].tolist()} want {want[bad][:4].tolist()}")


# ---------------------------------------------------------------------------------- linear

def _linear_case(M: int, K: int, N: int, bias: bool, seed: int = 0):
    g = _gen(seed * 1000 + M * 31 + K * 7 + N)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N", [7, 130])
@pytest.mark.parametrize("K", [33, 100, 576])
def test_linear_fp32_matches_f_linear(K, N, bias):
    for M in ROWS:
        x, w, b = _linear_case(M, K, N, bias)
        y = lin(x, w, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert y.dtype == torch.float32 and y.shape == (M, N)
        scale = want.abs().max().item()
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"M={M}: {m}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N", [7, 130])
@pytest.mark.parametrize("K", [33, 100, 576])
def test_linear_bf16_is_the_fp32_product_rounded(K, N, bias):
    """bf16 x and w: fp32 sums of exact bf16 products (vdpbf16ps), bias added in fp32, one
    rounding to bf16: within 1 ulp of the fp32 product, plus the sums' fp32 error."""
    for M in ROWS:
        x, w, b = (t if t is None else t.bfloat16() for t in _linear_case(M, K, N, bias))
        y = lin(x, w, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        err = (y.double() - want).abs()
        tol = bf16_ulp(want).double() + 1e-5 * want.abs().max()
        assert (err <= tol).all(), (M, (err - tol).max().item())


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N", [7, 130])
@pytest.mark.parametrize("K", [33, 100, 576])
def test_linear_int8_matches_dequantized_weights(K, N, bias, x_dtype):
    """int8 weights with per-row scales: F.linear on the dequantized weights, in fp64, within
    the int16 rounding of x."""
    for M in ROWS:
        x, w, b = _linear_case(M, K, N, bias, seed=1)
        q, s = quantize_int8(w)
        x = x.to(x_dtype)
        b = None if b is None else b.to(x_dtype)
        y = lin(x, q, b, s)
        wd = dequantize_int8(q, s, torch.float64)
        want = F.linear(x.double(), wd, None if b is None else b.double())
        assert y.dtype == x_dtype and y.shape == (M, N)
        # x rows are quantized to int16 (scale max|x| / 32767): each element within half a
        # step, so an output within half a step times the row's sum of |w|
        step = x.double().abs().amax(1, keepdim=True) / 32767
        tol = 0.5 * step * wd.abs().sum(1) + 1e-5 * want.abs().max().item()
        if x_dtype == torch.bfloat16:
            tol = tol + bf16_ulp(want).double()
        err = (y.double() - want).abs()
        assert (err <= tol).all(), (M, (err - tol).max().item())


def test_linear_reads_a_strided_x_and_a_wide_k():
    """x a column slice of a wider tensor (the kernel makes it contiguous); K = 2048 + 5."""
    g = _gen(3)
    wide = torch.randn(5, 2100, generator=g)
    x = wide[:, 40:40 + 2053]
    w = torch.randn(9, 2053, generator=g)
    want = F.linear(x.double(), w.double())
    torch.testing.assert_close(lin(x, w).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_linear_zero_rows():
    y = lin(torch.zeros(0, 16), torch.randn(3, 16))
    assert y.shape == (0, 3)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_wrapper_on_packed_and_plain_weights(dtype, quantized):
    """``epd.kernels.linear.linear`` keeps x's leading shape and gives the same values on a
    ``PackedWeight`` (the CPU kernel) as on the plain [N, K] weight (``F.linear``; int8
    dequantized to x's dtype), for a [2, 3, K] input and for 300 rows (many row tiles)."""
    K, N = 100, 130
    g = _gen(4)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g).to(dtype)
    x = torch.randn(300, K, generator=g).to(dtype)
    if quantized:
        q, s = quantize_int8(w)
        packed, plain = pack_weight(q, s), (q, b, s)
        # the kernel multiplies the int8 weights; F.linear their dequantization to x's dtype
        refs = {"packed": dequantize_int8(q, s, torch.float64), "plain": dequantize_int8(q, s, dtype).double()}
    else:
        packed, plain = pack_weight(w.to(dtype)), (w.to(dtype), b)
        refs = {"packed": w.to(dtype).double(), "plain": w.to(dtype).double()}
    assert isinstance(packed, PackedWeight) and packed.out_features == N

    def check(y, x2d, kind):
        want = F.linear(x2d.double(), refs[kind], b.double())
        tol = (1e-4 * want.abs().max() if dtype == torch.float32 or quantized
               else 2 * bf16_ulp(want).double() + 1e-5 * want.abs().max())
        if dtype == torch.bfloat16 and quantized:
            tol = tol + 2 * bf16_ulp(want).double()
        assert ((y.reshape(want.shape).double() - want).abs() <= tol).all()

    small = x[:6].reshape(2, 3, K)
    for kind, weight in (("packed", packed), ("plain", plain[0])):
        extra = (b,) if kind == "packed" else plain[1:]
        y_small = linear(small, weight, *extra)
        assert y_small.shape == (2, 3, N) and y_small.dtype == dtype
        check(y_small, x[:6], kind)
        y_big = linear(x.reshape(-1, 1, K), weight, *extra)
        assert y_big.shape == (300, 1, N) and y_big.dtype == dtype
        check(y_big, x, kind)


def test_pack_weight_applies_to_cpu_float_and_int8_weights_only():
    assert pack_weight(torch.randn(3, 8).half()) is None
    p = pack_weight(torch.randn(17, 9))
    assert p.data.shape == (2, 9, 16) and p.out_features == 17  # fp32: [N/16, K, 16]
    p = pack_weight(torch.randn(17, 9).bfloat16())
    assert p.data.shape == (2, 5, 16, 2)  # bf16 / int8: [N/16, K/2, 16, 2], zero-padded


# ---------------------------------------------------------------------------- quantize_int8

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_int8_round_trip_within_half_a_step(dtype):
    g = _gen(5)
    w = (torch.randn(37, 100, generator=g) * torch.logspace(-3, 2, 37)[:, None]).to(dtype)
    w[3] = 0  # an all-zero row
    w[4, 7] = -5.0  # a row whose extreme is negative
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (37,)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert q.abs().max() <= 127
    assert (q.abs().amax(dim=1)[[i for i in range(37) if i != 3]] == 127).all()  # each row's extreme maps to 127
    back = dequantize_int8(q, s, torch.float32)
    assert torch.isfinite(back).all()
    err = (back - w.float()).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-5)).all()
    assert (back[3] == 0).all() and (q[3] == 0).all()
    assert q[4, 7] == -127
    assert dequantize_int8(q, s, torch.bfloat16).dtype == torch.bfloat16


# ------------------------------------------------------------------------------ add_rms_norm

def _rms_norm(H: int, w: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(H, eps)
    norm.weight.data = w.clone()
    return norm


@pytest.mark.parametrize("T,H", [(1, 576), (5, 100), (700, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_rmsnorm(T, H, dtype, with_residual):
    g = _gen(6)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(H, generator=g)).to(dtype)
    residual = (3 * torch.randn(T, H, generator=g)).to(dtype)
    eps = 1e-5
    norm = _rms_norm(H, w, eps)
    if with_residual:
        want, want_res = norm(x, residual.clone())
        res = residual.clone()
        got = ext.add_rms_norm(x, res, w, eps)
        assert torch.equal(res, residual + x) and torch.equal(res, want_res)  # updated in place
    else:
        want = norm(x)
        got = ext.add_rms_norm(x, None, w, eps)
    assert got.dtype == dtype and got.shape == (T, H)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    # bf16 rounds twice, n = (x * rsqrt(mean(x^2) + eps)).to(bf16), then w * n: where the
    # two sums' order puts n on the other side of a rounding boundary (1 ulp of n), the
    # output moves by |w| ulps of n, up to 2 ulps of the output where |w| > 1
    src = (residual + x if with_residual else x).float()
    n = (src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()
    tol = bf16_ulp(torch.maximum(got.float().abs(), want.float().abs())) + w.float().abs() * bf16_ulp(n)
    assert ((got.float() - want.float()).abs() <= tol).all()
    assert (got == want).float().mean() >= 0.999


def test_add_rms_norm_leaves_x_alone_and_reads_a_strided_x():
    g = _gen(7)
    wide = torch.randn(4, 300, generator=g)
    x = wide[:, 10:110]
    w = torch.randn(100, generator=g)
    before = wide.clone()
    torch.testing.assert_close(ext.add_rms_norm(x, None, w, 1e-6), _rms_norm(100, w, 1e-6)(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(wide, before)


# -------------------------------------------------------------------------------------- rope

def _rotary(D: int, max_positions: int) -> RotaryEmbedding:
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return RotaryEmbedding(cfg, D, max_positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 16])
def test_rope_in_place_on_strided_qkv_views_matches_rotary_embedding(dtype, D):
    """q and k are views of a fused qkv row (row stride > heads * D), rotated in place; v untouched."""
    T, H, Hkv, P = 9, 4, 2, 64
    rot = _rotary(D, P)
    g = _gen(8)
    qkv = (4 * torch.randn(T, (H + 2 * Hkv) * D, generator=g)).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 63, 2, 2, 40, 33])
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    v_before = qkv[:, (H + Hkv) * D:].clone()
    want_q, want_k = rot(positions, q.clone(), k.clone())
    ext.rope(q, positions, rot.cos, rot.sin)
    ext.rope(k, positions, rot.cos, rot.sin)
    assert torch.equal(qkv[:, (H + Hkv) * D:], v_before)
    for got, want in ((q, want_q), (k, want_k)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert_within_ulp(got, want)


def test_rope_position_outside_the_table_raises():
    rot = _rotary(16, 8)
    x = torch.randn(2, 2, 16)
    before = x.clone()
    for bad in (8, -1):
        with pytest.raises(RuntimeError, match="outside the table"):
            ext.rope(x, torch.tensor([bad, 0]), rot.cos, rot.sin)
        assert torch.equal(x, before)  # the first row is the bad one: nothing written


# ---------------------------------------------------------------------------------- silu_mul

@pytest.mark.parametrize("T,inter", [(1, 1536), (7, 100), (600, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_silu_and_mul(T, inter, dtype):
    g = _gen(9)
    x = (3 * torch.randn(T, 2 * inter, generator=g)).to(dtype)
    got = ext.silu_mul(x)
    want = SiluAndMul()(x)
    assert got.dtype == dtype and got.shape == (T, inter)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert_within_ulp(got, want)


# ---------------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_the_reference_and_skips_negative_slots(dtype):
    B, bs, Hkv, D, T = 6, 4, 2, 16, 10
    g = _gen(10)
    qkv = torch.randn(T, (4 + 2 * Hkv) * D, generator=g).to(dtype)  # k, v: strided views of a fused row
    k = qkv[:, 4 * D:(4 + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (4 + Hkv) * D:].view(T, Hkv, D)
    slots = torch.randperm(B * bs, generator=g)[:T]
    slots[[2, 7]] = -1
    k_cache = torch.randn(B, bs, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(B, bs, Hkv, D, generator=g).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(k, v, want_k, want_v, slots)
    ext.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    ext.store_kv(k, v, k_cache, v_cache, slots.to(torch.int32))  # int32 slots too
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_store_kv_slot_past_the_cache_raises_and_writes_nothing_beyond():
    B, bs, Hkv, D = 3, 4, 2, 8
    g = _gen(11)
    k_buf = torch.randn(B + 1, bs, Hkv, D, generator=g)
    v_buf = torch.randn(B + 1, bs, Hkv, D, generator=g)
    k_cache, v_cache = k_buf[:B], v_buf[:B]  # contiguous views; block B lies just past them
    k_tail, v_tail = k_buf[B].clone(), v_buf[B].clone()
    k = torch.randn(2, Hkv, D, generator=g)
    v = torch.randn(2, Hkv, D, generator=g)
    for bad in (B * bs, B * bs + 3, 10**6):
        with pytest.raises(RuntimeError, match="outside the cache"):
            ext.store_kv(k, v, k_cache, v_cache, torch.tensor([bad, 1]))
        assert torch.equal(k_buf[B], k_tail) and torch.equal(v_buf[B], v_tail)


# -------------------------------------------------------------------------- argument checks

def _raises(fn, *args, match: str):
    with pytest.raises(RuntimeError, match=match):
        fn(*args)


def test_linear_refuses_bad_arguments():
    x32, w32 = torch.randn(2, 16), torch.randn(3, 16)
    xb, wb = x32.bfloat16(), w32.bfloat16()
    q, s = quantize_int8(w32)
    p32, pb, pq = (ext.pack_linear_weight(w) for w in (w32, wb, q))
    _raises(ext.linear, xb, p32, 3, match="fp32 weights need float32 x")
    _raises(ext.linear, x32, pb, 3, match="bf16 weights need bfloat16 x")
    _raises(ext.linear, x32.half(), p32, 3, match="float32 or bfloat16")
    _raises(ext.linear, torch.randn(2, 15), p32, 3, match=r"packed weight must be \[1, 15, 16\]")
    _raises(ext.linear, torch.randn(2, 14).bfloat16(), pb, 3, match=r"packed weight must be \[1, 7, 16, 2\]")
    _raises(ext.linear, x32, p32, 17, match="packed weight must be")  # 17 outputs need 2 blocks
    _raises(ext.linear, x32[0], p32, 3, match=r"x must be \[M, K\]")
    _raises(ext.linear, x32, p32.transpose(1, 2), 3, match="contiguous")
    _raises(ext.linear, x32, p32, 3, torch.randn(4), match="bias has 4 elements")
    _raises(ext.linear, x32, pq, 3, match="w_scale")
    _raises(ext.linear, x32, pq, 3, None, s[:2], match="w_scale")
    _raises(ext.linear, x32, pq, 3, None, s.double(), match="w_scale")
    _raises(ext.linear, x32, p32, 3, None, s, match="w_scale is for int8 weights only")
    _raises(ext.pack_linear_weight, torch.randn(3, 4).half(), match="float32, bfloat16 or int8")
    _raises(ext.pack_linear_weight, torch.randn(3), match=r"\[N, K\]")


def test_elementwise_kernels_refuse_bad_arguments():
    x = torch.randn(3, 8)
    w = torch.randn(8)
    _raises(ext.add_rms_norm, x, None, w.bfloat16(), 1e-6, match="add_rms_norm_cpu")
    _raises(ext.add_rms_norm, x, None, torch.randn(7), 1e-6, match="add_rms_norm_cpu")
    _raises(ext.add_rms_norm, x, torch.randn(3, 7), w, 1e-6, match="residual")
    _raises(ext.add_rms_norm, x.half(), None, w.half(), 1e-6, match="not supported")
    _raises(ext.silu_mul, torch.randn(3, 7), match=r"silu_mul_cpu: x \[T, 2 \* I\]")
    _raises(ext.silu_mul, torch.randn(3, 8).half(), match="not supported")
    rot = _rotary(16, 8)
    q = torch.randn(2, 2, 16)
    _raises(ext.rope, q, torch.tensor([0, 1], dtype=torch.int32), rot.cos, rot.sin, match="int64")
    _raises(ext.rope, q, torch.tensor([0]), rot.cos, rot.sin, match="int64")
    _raises(ext.rope, q, torch.tensor([0, 1]), rot.cos.double(), rot.sin, match="float32")
    _raises(ext.rope, torch.randn(2, 2, 8), torch.tensor([0, 1]), rot.cos, rot.sin, match="cos / sin")
    _raises(ext.rope, q.half(), torch.tensor([0, 1]), rot.cos, rot.sin, match="not supported")
    _raises(ext.rope, torch.randn(2, 16, 2).transpose(1, 2), torch.tensor([0, 1]), rot.cos, rot.sin,
            match="rows dense")
    k, cache = torch.randn(2, 2, 8), torch.zeros(3, 4, 2, 8)
    _raises(ext.store_kv, k.bfloat16(), k.bfloat16(), cache, cache.clone(), torch.tensor([0, 1]),
            match="cache's dtype")
    _raises(ext.store_kv, torch.randn(2, 3, 8), torch.randn(2, 3, 8), cache, cache.clone(), torch.tensor([0, 1]),
            match="Hkv and D")


# Arguments the kernels once did not check (found by these tests). Each case is built so
# that what a kernel would read or write out of the arguments' bounds stays inside a larger
# buffer this test owns.

def test_add_rms_norm_strided_weight_is_read_right_or_refused():
    g = _gen(12)
    x = torch.randn(3, 8, generator=g)
    w = torch.randn(16, generator=g)[::2]
    try:
        got = ext.add_rms_norm(x, None, w, 1e-6)
    except RuntimeError:
        return
    torch.testing.assert_close(got, _rms_norm(8, w, 1e-6)(x), rtol=1e-6, atol=1e-6)


def test_rope_refuses_a_sin_table_shorter_than_cos():
    rot = _rotary(16, 8)
    sin = rot.sin.clone()[:2]  # contiguous; rows 2.. of its storage are what the kernel would read
    with pytest.raises(RuntimeError):
        ext.rope(torch.randn(2, 2, 16), torch.tensor([7, 1]), rot.cos, sin)


def test_store_kv_refuses_a_v_cache_smaller_than_k_cache():
    k, v = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    v_buf = torch.zeros(3, 4, 2, 8)
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), v_buf[:1]
    try:
        ext.store_kv(k, v, k_cache, v_cache, torch.tensor([10]))  # block 2: inside k_cache, past v_cache
    except RuntimeError:
        pass
    assert torch.equal(v_buf[1:], torch.zeros(2, 4, 2, 8)), "written past v_cache"


def test_store_kv_refuses_v_of_another_dtype_than_k():
    k, k_cache = torch.randn(2, 2, 8), torch.zeros(3, 4, 2, 8)
    v = torch.randn(4, 2, 8).bfloat16()[:2]  # rows 2-3 lie where a 4-byte row copy reads
    v_cache = torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        ext.store_kv(k, v, k_cache, v_cache, torch.tensor([0, 1]))


@pytest.mark.parametrize("case", ["v_fewer_heads", "v_fewer_rows", "short_slot_mapping"])
def test_store_kv_refuses_v_or_slots_that_do_not_match_k(case):
    k, cache = torch.randn(4, 2, 8), torch.zeros(3, 4, 2, 8)
    v_buf = torch.randn(4, 2, 8)
    slot_buf = torch.tensor([0, -1, -1, -1])
    v, slots = {"v_fewer_heads": (v_buf[:, :1], slot_buf.clone()), "v_fewer_rows": (v_buf[:3], slot_buf.clone()),
                "short_slot_mapping": (v_buf, slot_buf[:1])}[case]
    with pytest.raises(RuntimeError):
        ext.store_kv(k, v, cache, cache.clone(), slots)
