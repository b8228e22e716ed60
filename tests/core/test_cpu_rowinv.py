"""The cpu backend's row-invariant bf16 kernels (backends/cpu/rowinv.cpp): exact against a
reference, and a row's bits independent of the other rows, its position and the thread count.
The linear tests run on each path the CPU has (avx2; avx512 and amx where present). The first run
builds the extension (~40 s)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from polyspec.backends.cpu import rowinv


@pytest.fixture(scope="session", autouse=True)
def built() -> None:
    if rowinv.load() is None:
        pytest.skip(f"rowinv unavailable: {rowinv.unavailable_reason()}")


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


NEEDS = {"avx512": "AVX-512 (F + BW)", "amx": "AMX-TILE + AMX-BF16 (or Linux's grant to use them)"}


@pytest.fixture(params=["avx2", "avx512", "amx"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on one path of rowinv.linear, then restore the one that ran before."""
    name = request.param
    if name not in rowinv.available_isas():
        pytest.skip(f"this CPU lacks {NEEDS[name]}, so the {name} path cannot run here")
    saved = rowinv.isa()
    rowinv.set_isa(name)
    try:
        yield name
    finally:
        rowinv.set_isa(saved)


def bf16_rand(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).bfloat16()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (also for NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


# ------------------------------------------------------------------------------------- linear

LINEAR_CASES = [  # (M, N, K); K % 32 in {0, 1, 5, 8, 15, 16, 17} covers both paths' tails
    (1, 576, 576),
    (6, 192, 576),
    (7, 100, 1536),
    (16, 64, 576),
    (3, 37, 40),
    (5, 9, 37),
    (2, 8, 1),
    (4, 24, 15),
    (9, 16, 17),
    (8, 20, 48),
    (11, 13, 81),
    (130, 40, 64),
]


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("m,n,k", LINEAR_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_fp32_matches_reference(m: int, n: int, k: int, with_bias: bool) -> None:
    x, w = bf16_rand(m, k, seed=1), bf16_rand(n, k, seed=2)
    b = bf16_rand(n, seed=3) if with_bias else None
    y = rowinv.linear(x.float(), w, b)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    ref32 = F.linear(x.float(), w.float(), None if b is None else b.float())
    ref64 = F.linear(x.double(), w.double(), None if b is None else b.double())
    # fp32 accumulation error is bounded by ~K * eps * sum|x*w|; typical error is far smaller.
    mag = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    assert ((y.double() - ref64).abs() <= 1e-6 * mag + 1e-30).all()
    torch.testing.assert_close(y, ref32, rtol=1e-5, atol=1e-5 * float(mag.max()))


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("m,n,k", LINEAR_CASES)
def test_linear_bf16_within_one_ulp(m: int, n: int, k: int) -> None:
    x, w, b = bf16_rand(m, k, seed=4), bf16_rand(n, k, seed=5), bf16_rand(n, seed=6)
    y = rowinv.linear(x, w, b)
    assert y.dtype == torch.bfloat16
    ref = F.linear(x.double(), w.double(), b.double())
    # bf16 has 8 significant bits: one ulp at |ref| is 2^(floor(log2|ref|) - 7).
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    assert ((y.double() - ref).abs() <= ulp).all()
    # The bf16 output is exactly the RNE rounding of the same path's fp32 sums.
    assert same(y, rowinv.linear(x, w, b, out_dtype=torch.float32).bfloat16())
    if rowinv.isa() != "amx":  # fp32 x runs the same sums (amx: fp32 x runs the avx512 kernel)
        assert same(y, rowinv.linear(x.float(), w, b).bfloat16())


def emulate_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, lanes: int):
    """The fixed op sequence of the path with `lanes` fp32 lanes (rowinv.cpp, Kernel 1), one
    fp32 rounding per op: per 2*lanes-wide K block (zero-padded), lane i takes fma(x[2i], w[2i])
    then fma(x[2i+1], w[2i+1]); then the horizontal sum, + bias. x, w, b hold bf16 values; each
    op is computed in float64 and rounded to fp32, which is exact here: products of two bf16 have
    16 bits, so a sum needs more than float64's 53 bits only when one side is below 2^-29 of the
    other, and then both roundings give the larger side."""

    def r32(t: torch.Tensor) -> torch.Tensor:
        return t.float().double()

    m, k = x.shape
    block = 2 * lanes
    pad = -k % block
    xb = F.pad(x.double(), (0, pad)).reshape(m, 1, -1, lanes, 2)
    wb = F.pad(w.double(), (0, pad)).reshape(1, w.shape[0], -1, lanes, 2)
    acc = torch.zeros(m, w.shape[0], lanes, dtype=torch.float64)
    for blk in range(xb.shape[2]):
        for parity in (0, 1):
            acc = r32(xb[:, :, blk, :, parity] * wb[:, :, blk, :, parity] + acc)
    while acc.shape[-1] > 1:  # 16 lanes: i + (i+8) first; then ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))
        half = acc.shape[-1] // 2
        acc = r32(acc[..., :half] + acc[..., half:])
    y = acc[..., 0]
    return (y if b is None else r32(y + b.double())).float()


@pytest.mark.parametrize("m,n,k", [(1, 24, 576), (7, 40, 100), (9, 13, 37), (3, 10, 1536)])
def test_linear_exact_op_sequence(isa: str, m: int, n: int, k: int) -> None:
    # Bitwise the documented order of each path (which makes their bits differ from each other).
    # amx: fp32 x runs the avx512 kernel; its bf16 sums are the tile unit's own (next test).
    x, w, b = bf16_rand(m, k, seed=40), bf16_rand(n, k, seed=41), bf16_rand(n, seed=42)
    lanes = {"avx2": 8, "avx512": 16, "amx": 16}[isa]
    assert same(rowinv.linear(x.float(), w, b), emulate_linear(x, w, b, lanes))
    assert same(rowinv.linear(x.float(), w), emulate_linear(x, w, None, lanes))
    if isa != "amx":
        assert same(rowinv.linear(x, w, b), emulate_linear(x, w, b, lanes).bfloat16())


@pytest.mark.parametrize("m,n,k", LINEAR_CASES)
def test_linear_amx_accuracy(m: int, n: int, k: int) -> None:
    """The amx path's fp32 sums against float64. TDPBF16PS's internal summation order is not
    documented bit for bit (fp32 emulations of pair sums, trees of them and exact block sums
    each match it on only 8-12 of 16 dot products of length 576), so its bits are checked for
    invariance in the other tests and its error here: fp32-level, like the other paths'."""
    if "amx" not in rowinv.available_isas():
        pytest.skip(f"this CPU lacks {NEEDS['amx']}, so the amx path cannot run here")
    x, w, b = bf16_rand(m, k, seed=46), bf16_rand(n, k, seed=47), bf16_rand(n, seed=48)
    saved = rowinv.isa()
    rowinv.set_isa("amx")
    try:
        y = rowinv.linear(x, w, b, out_dtype=torch.float32)
    finally:
        rowinv.set_isa(saved)
    ref = F.linear(x.double(), w.double(), b.double())
    mag = F.linear(x.double().abs(), w.double().abs()) + b.double().abs()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert ((y.double() - ref).abs() <= 1e-6 * mag + 1e-30).all()


# Invariance tests run with fp32 output as well: it has no final rounding to hide a 1-ulp
# difference in the accumulation order (bf16 output would mask almost all of them). KINDS: x in
# fp32; x in bf16 (bf16 out); x in bf16 with fp32 out (the amx path's own sums: fp32 x runs the
# avx512 kernel there).
KINDS = ["fp32", "bf16", "bf16->fp32"]


def lin(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kind: str) -> torch.Tensor:
    if kind == "fp32":
        return rowinv.linear(x.float(), w, b)
    out = torch.float32 if kind == "bf16->fp32" else None
    return rowinv.linear(x.bfloat16(), w, b, out_dtype=out)


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("k", [576, 1536, 37])
@pytest.mark.parametrize("kind", KINDS)
def test_linear_row_invariance(k: int, kind: str) -> None:
    # 20 rows: the amx path packs x in 8-row transposes with the rest one row at a time, and
    # splits 20 rows into blocks of 16 and 4
    x, w, b = bf16_rand(20, k, seed=7), bf16_rand(72, k, seed=8), bf16_rand(72, seed=9)
    y = lin(x, w, b, kind)
    for i in range(20):
        assert same(lin(x[i : i + 1], w, b, kind), y[i : i + 1]), f"row {i} alone differs"
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    inv = torch.argsort(perm)
    assert same(lin(x[perm], w, b, kind)[inv], y)
    for m in range(1, 21):  # every row-block plan (tile heights and their mixes) sees the same rows
        assert same(lin(x[:m], w, b, kind), y[:m]), f"prefix M={m} differs"
    for pos in range(5):  # row 0 surrounded by unrelated rows, at each position
        others = bf16_rand(4, k, seed=100 + pos)
        xx = torch.cat([others[:pos], x[:1], others[pos:]])
        assert same(lin(xx, w, b, kind)[pos], y[0])


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("kind", KINDS)
def test_linear_every_m_matches_single_rows(kind: str) -> None:
    # M = 1..17 at two offsets: every tile height, two-block split and remainder of each path
    # (amx: B tiles of 1..16 rows, then two m blocks); N = 21 adds column leftovers (a partial
    # 16-column block), K = 100 a K tail.
    x, w, b = bf16_rand(20, 100, seed=43), bf16_rand(21, 100, seed=44), bf16_rand(21, seed=45)
    singles = torch.cat([lin(x[i : i + 1], w, b, kind) for i in range(20)])
    for m in range(1, 18):
        for start in (0, 3):
            got = lin(x[start : start + m], w, b, kind)
            assert same(got, singles[start : start + m]), f"M={m} from row {start} differs"


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("kind", ["fp32", "bf16->fp32"])
def test_linear_row_invariance_large_m(kind: str) -> None:
    # M = 300 with K = 1536 runs in several row chunks (amx: 19 m blocks); every row must still
    # match M = 1.
    x, w = bf16_rand(300, 1536, seed=10), bf16_rand(24, 1536, seed=11)
    y = lin(x, w, None, kind)
    singles = torch.cat([lin(x[i : i + 1], w, None, kind) for i in range(300)])
    assert same(y, singles)
    assert same(lin(x[:137], w, None, kind), y[:137])


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("kind", ["fp32", "bf16->fp32"])
def test_linear_column_path_invariance(kind: str) -> None:
    # N = 13: groups of 8 and 5 columns, so 4- or 2-wide tiles and a 1-wide leftover; each column
    # must match the same column computed alone (always a 1-wide tile). N = 100 (amx): groups of
    # 4, 2 and 1 C tiles, the last one partial, against each column alone (a padded copy).
    for n in (13, 100):
        x, w = bf16_rand(9, 64, seed=12), bf16_rand(n, 64, seed=13)
        for m in (1, 2, 3, 5, 8, 9):
            y = lin(x[:m], w, None, kind)
            for j in range(n):
                alone = lin(x[:m], w[j : j + 1].contiguous(), None, kind)
                assert same(alone, y[:, j : j + 1]), f"N={n} column {j} at M={m} differs"


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("m", [1, 6, 200])
@pytest.mark.parametrize("kind", ["fp32", "bf16->fp32"])
def test_linear_thread_count_invariance(m: int, kind: str) -> None:
    x, w, b = bf16_rand(m, 576, seed=14), bf16_rand(1000, 576, seed=15), bf16_rand(1000, seed=16)
    with num_threads(1):
        y1 = lin(x, w, b, kind)
    with num_threads(2):
        y2 = lin(x, w, b, kind)
    assert same(y1, y2)


@pytest.mark.usefixtures("isa")
def test_linear_leading_dims_and_empty() -> None:
    x, w = bf16_rand(2, 3, 40, seed=17), bf16_rand(8, 40, seed=18)
    y = rowinv.linear(x, w)
    assert y.shape == (2, 3, 8)
    assert same(y.reshape(6, 8), rowinv.linear(x.reshape(6, 40), w))
    empty = rowinv.linear(torch.empty(0, 40, dtype=torch.bfloat16), w)
    assert empty.shape == (0, 8)
    b = bf16_rand(8, seed=19)  # K = 0: an empty sum, so just the bias
    assert same(
        rowinv.linear(
            torch.empty(3, 0, dtype=torch.bfloat16), torch.empty(8, 0, dtype=torch.bfloat16), b
        ),
        b.expand(3, 8).contiguous(),
    )


def test_linear_errors() -> None:
    x, w = bf16_rand(2, 16, seed=20), bf16_rand(4, 16, seed=21)
    mod = rowinv.load()
    with pytest.raises(RuntimeError, match="w must be a 2-D bfloat16"):
        rowinv.linear(x, w.float())
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        rowinv.linear(x.double(), w)
    with pytest.raises(RuntimeError, match="but w is"):
        rowinv.linear(bf16_rand(2, 15, seed=22), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        rowinv.linear(x, bf16_rand(16, 4, seed=23).t())
    with pytest.raises(RuntimeError, match="bias must be"):
        rowinv.linear(x, w, bf16_rand(5, seed=24))
    with pytest.raises(RuntimeError, match="2-D"):
        mod.linear(x.reshape(1, 2, 16), w, None)


# ---------------------------------------------------------------------------------- attention


def make_attention(lens: list[int], hq: int, hkv: int, d: int, seed: int, slots: int | None = None):
    g = torch.Generator().manual_seed(seed)
    s = slots or sum(lens) + 7
    q = torch.randn(len(lens), hq, d, generator=g).bfloat16()
    k = torch.randn(s, hkv, d, generator=g).bfloat16()
    v = torch.randn(s, hkv, d, generator=g).bfloat16()
    indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    indices = torch.randint(0, s, (sum(lens),), generator=g, dtype=torch.int64)
    return q, k, v, indptr, indices


def attention_reference(q, k, v, indptr, indices, scale) -> torch.Tensor:
    t_rows, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.empty(t_rows, hq, d, dtype=torch.float64)
    for t in range(t_rows):
        idx = indices[indptr[t] : indptr[t + 1]]
        for h in range(hq):
            kk = k[idx, h // group].double()  # [L, D]
            vv = v[idx, h // group].double()
            p = torch.softmax(scale * (kk @ q[t, h].double()), dim=0)
            out[t, h] = p @ vv
    return out


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.bfloat16
    # One bf16 rounding of an fp32 result: within ~1 ulp (2^-8 relative) plus fp32 noise.
    assert ((out.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-4).all()


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (6, 1, 8), (2, 2, 72)])
def test_attention_matches_reference(hq: int, hkv: int, d: int, isa: str) -> None:
    lens = [1, 5, 8, 9, 33, 400]
    q, k, v, indptr, indices = make_attention(lens, hq, hkv, d, seed=30)
    scale = d**-0.5
    ref = attention_reference(q, k, v, indptr, indices, scale)
    out = rowinv.attention(q, k, v, indptr, indices, scale)
    assert out.shape == q.shape
    assert_close_bf16(out, ref)
    out32 = rowinv.attention(q, k, v, indptr, indices, scale, out_dtype=torch.float32)
    assert out32.dtype == torch.float32
    assert ((out32.double() - ref).abs() <= 1e-5 * ref.abs() + 2e-6).all()  # fp32-level agreement
    assert same(out, out32.bfloat16())  # bf16 output is exactly the RNE rounding of the fp32 one


def test_attention_extreme_scores() -> None:
    # Score gaps of hundreds: exp must underflow to exactly 0 without NaN, the max must dominate.
    q, k, v, indptr, indices = make_attention([3, 50], 3, 3, 64, seed=31)
    scale = 8.0
    out = rowinv.attention(q, k, v, indptr, indices, scale)
    assert torch.isfinite(out.float()).all()
    assert_close_bf16(out, attention_reference(q, k, v, indptr, indices, scale))


F32 = torch.float32
SCALE = 0.1  # not a power of two, so where the scale is applied matters to the bits


def test_attention_row_invariance(isa: str) -> None:
    lens = [7, 1, 300, 16, 45, 2]
    q, k, v, indptr, indices = make_attention(lens, 9, 3, 64, seed=32)
    out = rowinv.attention(q, k, v, indptr, indices, SCALE, out_dtype=F32)
    for t, n in enumerate(lens):
        lo = int(indptr[t])
        alone = rowinv.attention(
            q[t : t + 1],
            k,
            v,
            torch.tensor([0, n]),
            indices[lo : lo + n].clone(),
            SCALE,
            out_dtype=F32,
        )
        assert same(alone, out[t : t + 1]), f"row {t} alone differs"
    order = [3, 0, 5, 1, 4, 2]  # same rows, other neighbours and positions
    idx2 = torch.cat([indices[int(indptr[t]) : int(indptr[t + 1])] for t in order])
    ptr2 = torch.tensor([0] + torch.tensor([lens[t] for t in order]).cumsum(0).tolist())
    assert same(rowinv.attention(q[order], k, v, ptr2, idx2, SCALE, out_dtype=F32), out[order])
    # A verify-style batch: row t sees the first n + t slots of one sequence; each row must match
    # the same row computed alone (as plain decoding would).
    seq = indices[:64]
    ptr3 = torch.tensor([0] + torch.tensor([40 + t for t in range(6)]).cumsum(0).tolist())
    idx3 = torch.cat([seq[: 40 + t] for t in range(6)])
    batch = rowinv.attention(q[:6], k, v, ptr3, idx3, SCALE, out_dtype=F32)
    for t in range(6):
        alone = rowinv.attention(
            q[t : t + 1],
            k,
            v,
            torch.tensor([0, 40 + t]),
            seq[: 40 + t].clone(),
            SCALE,
            out_dtype=F32,
        )
        assert same(alone, batch[t : t + 1])


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (6, 1, 8), (2, 2, 72), (8, 2, 96),
                                      (16, 4, 64), (5, 5, 40), (12, 3, 24), (3, 1, 136)])  # fmt: skip
def test_attention_bits_same_on_every_isa(hq: int, hkv: int, d: int) -> None:
    """The AVX-512 attention (also under "amx") runs the AVX2 kernel's operations lane for
    lane, so every path gives the same bits: plain decoding and verify agree whichever runs,
    and so do machines with and without AVX-512. Key counts around the 8-key blocks, head
    sizes with a trailing 8 or 16 lanes, group sizes 1-4 and 5."""
    lens = [1, 3, 7, 8, 9, 15, 16, 17, 33, 250, 401]
    q, k, v, indptr, indices = make_attention(lens, hq, hkv, d, seed=36, slots=600)
    saved = rowinv.isa()
    outs = {}
    try:
        for name in rowinv.available_isas():
            rowinv.set_isa(name)
            outs[name] = rowinv.attention(q, k, v, indptr, indices, SCALE, out_dtype=F32)
    finally:
        rowinv.set_isa(saved)
    if len(outs) == 1:
        pytest.skip("this CPU has only the avx2 path")
    for name, out in outs.items():
        assert same(out, outs["avx2"]), f"{name} attention differs from avx2's"


def test_attention_gqa_mapping() -> None:
    # v of kv head g is the constant 2^g: the softmax average is then exactly 2^g (power-of-two
    # scaling commutes with rounding), so head h must read kv head h // (Hq // Hkv).
    q, k, v, indptr, indices = make_attention([4, 19], 9, 3, 64, seed=33)
    v = torch.stack([torch.full_like(v[:, 0], 2.0**g) for g in range(3)], dim=1)
    out = rowinv.attention(q, k, v, indptr, indices, SCALE, out_dtype=F32)
    for h in range(9):
        assert (out[:, h] == 2.0 ** (h // 3)).all(), f"head {h}"


def test_attention_thread_invariance_and_strided_pool() -> None:
    lens = [33, 2, 129, 64, 1, 77, 400, 5]
    q, k, v, indptr, indices = make_attention(lens, 9, 3, 64, seed=34)
    with num_threads(1):
        o1 = rowinv.attention(q, k, v, indptr, indices, SCALE, out_dtype=F32)
    with num_threads(2):
        o2 = rowinv.attention(q, k, v, indptr, indices, SCALE, out_dtype=F32)
    assert same(o1, o2)
    pool = torch.stack([k, v], dim=1)  # [S, 2, Hkv, D]: k and v share a slot, non-contiguous views
    assert same(
        rowinv.attention(q, pool[:, 0], pool[:, 1], indptr, indices, SCALE, out_dtype=F32), o2
    )


def test_attention_errors() -> None:
    q, k, v, indptr, indices = make_attention([3, 4], 9, 3, 64, seed=35)
    with pytest.raises(RuntimeError, match="empty"):
        rowinv.attention(q, k, v, torch.tensor([0, 3, 3]), indices, 0.125)
    bad = indices.clone()
    bad[5] = k.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        rowinv.attention(q, k, v, indptr, bad, 0.125)
    bad[5] = -1
    with pytest.raises(RuntimeError, match="out of range"):
        rowinv.attention(q, k, v, indptr, bad, 0.125)
    with pytest.raises(RuntimeError, match="exceeds"):
        rowinv.attention(q, k, v, torch.tensor([0, 3, 9]), indices, 0.125)
    with pytest.raises(RuntimeError, match="kv_indptr must be int64"):
        rowinv.attention(q, k, v, indptr[:2], indices, 0.125)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        rowinv.attention(q[:, :8], k, v, indptr, indices, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        rowinv.attention(
            q[..., :12].contiguous(),
            k[..., :12].contiguous(),
            v[..., :12].contiguous(),
            indptr,
            indices,
            0.125,
        )
    with pytest.raises(RuntimeError, match="q must be"):
        rowinv.attention(q.float(), k, v, indptr, indices, 0.125)
    with pytest.raises(RuntimeError, match="k_cache must be"):
        rowinv.attention(q, k.float(), v, indptr, indices, 0.125)


# ------------------------------------------------------------------------------------- loader


def test_load_reports_instead_of_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rowinv.unavailable_reason() == ""
    build = rowinv._build.__wrapped__  # bypass the per-process cache
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    module, reason = build()
    assert module is None and "AVX2" in reason
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    module, reason = build()
    assert module is None and "compiler" in reason


def test_isa_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """POLYSPEC_ROWINV_ISA / set_isa pick the linear path; wrong or unavailable choices are
    errors that say what is allowed."""
    from polyspec.errors import ConfigError

    available = rowinv.available_isas()
    assert available[0] == "avx2" and set(available) <= {"avx2", "avx512", "amx"}
    assert "amx" not in available or "avx512" in available  # amx's fp32 inputs run avx512
    saved = rowinv.isa()
    try:
        rowinv.set_isa("auto")
        assert rowinv.isa() == available[-1]  # the best one
        for name in available:
            rowinv.set_isa(name)
            assert rowinv.isa() == name
    finally:
        rowinv.set_isa(saved)
    with pytest.raises(ValueError, match="'avx512bw'.*'auto', 'avx2', 'avx512' or 'amx'"):
        rowinv.set_isa("avx512bw")
    with pytest.raises(RuntimeError, match="unknown ISA 'sse'.*'auto', 'avx2', 'avx512' or 'amx'"):
        rowinv.load().set_isa("sse")

    monkeypatch.setenv("POLYSPEC_ROWINV_ISA", "AVX-512")
    with pytest.raises(
        ConfigError, match="POLYSPEC_ROWINV_ISA='AVX-512'.*'auto'.*'avx2'.*'avx512'.*'amx'"
    ):
        rowinv._build.__wrapped__()  # before any build: a typo is not a reason to fall back
    monkeypatch.setenv("POLYSPEC_ROWINV_ISA", " avx2 ")
    assert rowinv._isa_request() == "avx2"

    class AVX2Only:  # the module as an AVX2-only CPU reports itself
        def available_isas(self) -> list[str]:
            return ["avx2"]

        def set_isa(self, name: str) -> None:
            assert name in ("auto", "avx2")

    with pytest.raises(ConfigError, match="'avx512', but this CPU cannot run it.*: avx2$"):
        rowinv._apply_isa(AVX2Only(), "avx512")
    with pytest.raises(ConfigError, match="'amx', but this CPU cannot run it.*AMX-BF16.*: avx2$"):
        rowinv._apply_isa(AVX2Only(), "amx")
    rowinv._apply_isa(AVX2Only(), "auto")


def test_cpu_backend_kernel_choice(monkeypatch):
    """bf16 linears and attention of the cpu backend use these kernels unless
    POLYSPEC_CPU_KERNELS=torch; a wrong value is an error that names the choices."""
    from polyspec.backends.common import SDPAAttention
    from polyspec.backends.cpu.backend import CPUBackend
    from polyspec.errors import ConfigError

    w = torch.randn(24, 40).bfloat16()
    x = torch.randn(5, 40).bfloat16()
    backend = CPUBackend()
    pool = backend.make_kv_pool(16, 1, 2, 8, torch.bfloat16)
    attn = backend.make_attention(pool, 4, 2, 8, 0.35)
    assert isinstance(attn, SDPAAttention) and attn.exact_attention is rowinv.attention
    assert same(backend.linear_fn(w)(x, None), rowinv.linear(x, w))
    fp32_pool = backend.make_kv_pool(16, 1, 2, 8, torch.float32)
    assert backend.make_attention(fp32_pool, 4, 2, 8, 0.35).exact_attention is None

    monkeypatch.setenv("POLYSPEC_CPU_KERNELS", "torch")
    stock = CPUBackend()
    assert stock.row_invariant_kernels() is None
    assert stock.make_attention(pool, 4, 2, 8, 0.35).exact_attention is None
    monkeypatch.setenv("POLYSPEC_CPU_KERNELS", "fast")
    with pytest.raises(ConfigError, match="POLYSPEC_CPU_KERNELS='fast'.*'auto'.*'torch'"):
        CPUBackend()


def _within_one_bf16_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    gap = (a.float() - b.float()).abs()
    return bool((gap <= b.float().abs() * 2**-7 + 1e-30).all())


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_layer_ops_match_the_reference(rows):
    """Norms, SiLU-and-mul and rotary in one call each, with the reference's roundings."""
    from polyspec.kernels import reference as ref

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).bfloat16()
    res = torch.randn(rows, 576, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    assert _within_one_bf16_ulp(rowinv.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    normed, total = rowinv.fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_total = ref.fused_add_rms_norm(x, res, w, 1e-5)
    assert same(total, ref_total) and _within_one_bf16_ulp(normed, ref_normed)
    gate_up = torch.randn(rows, 2 * 1540, generator=g).bfloat16() * 4  # I % 8 != 0: a tail
    assert _within_one_bf16_ulp(rowinv.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    pos = torch.randint(0, 300, (rows,), generator=g)
    q = torch.randn(rows, 9, 64, generator=g).bfloat16()
    k = torch.randn(rows, 3, 64, generator=g).bfloat16()
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    angles = torch.arange(300).float()[:, None] * inv[None]
    cache = torch.cat([angles.cos(), angles.sin()], 1)  # [max_pos, D]
    for neox in (True, False):
        got, want = (
            rowinv.rotary_embedding(pos, q, k, cache, neox),
            ref.rotary_embedding(pos, q, k, cache, neox),
        )
        assert same(got[0], want[0]) and same(got[1], want[1])
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        rowinv.rotary_embedding(torch.full((rows,), 300), q, k, cache, True)


def test_layer_ops_are_row_invariant_and_keep_nans():
    """SiLU-and-mul splits rows into column chunks across threads, and the norms round 8 lanes
    at a time: a row's bits must not depend on the rows beside it, and a NaN stays a NaN."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 2 * 1540, generator=g).bfloat16() * 4
    x[3, 17] = float("nan")
    x[5, 1540 + 9] = float("inf")
    together = rowinv.silu_and_mul(x)
    assert all(same(together[i : i + 1], rowinv.silu_and_mul(x[i : i + 1])) for i in range(24))
    assert together[3, 17].isnan() and not together[3, 16].isnan()
    h = torch.randn(24, 576, generator=g).bfloat16()
    res = torch.randn(24, 576, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    normed, total = rowinv.fused_add_rms_norm(h, res, w, 1e-5)
    for i in range(24):
        n1, t1 = rowinv.fused_add_rms_norm(h[i : i + 1], res[i : i + 1], w, 1e-5)
        assert same(n1, normed[i : i + 1]) and same(t1, total[i : i + 1])
    h[2, 5] = float("nan")
    assert rowinv.rms_norm(h, w, 1e-5)[2].isnan().all()


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 40), (8, 4, 72), (6, 1, 16), (4, 2, 128)])
def test_grouped_attention_equals_one_head_at_a_time(hq, hkv, d):
    """Query heads that share a kv head are attended together (each key row read once for the
    group); every head's bits must be those of attending it alone (a one-head call, where the
    group size is 1 and the per-head path runs), in bf16 and in the fp32 view."""
    g = torch.Generator().manual_seed(hq * 100 + d)
    t, slots = 5, 200
    q = torch.randn(t, hq, d, generator=g).bfloat16()
    k = torch.randn(slots, hkv, d, generator=g).bfloat16()
    v = torch.randn(slots, hkv, d, generator=g).bfloat16()
    lens = torch.randint(1, 90, (t,), generator=g)
    indptr = torch.zeros(t + 1, dtype=torch.long)
    indptr[1:] = lens.cumsum(0)
    indices = torch.randint(0, slots, (int(indptr[-1]),), generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        together = rowinv.attention(q, k, v, indptr, indices, 0.125, dtype)
        for h in range(hq):
            kv = h // (hq // hkv)
            alone = rowinv.attention(
                q[:, h : h + 1].contiguous(),
                k[:, kv : kv + 1].contiguous(),
                v[:, kv : kv + 1].contiguous(),
                indptr,
                indices,
                0.125,
                dtype,
            )
            assert same(together[:, h : h + 1], alone), (h, dtype)


def test_cpu_backend_layer_ops_dispatch_by_dtype():
    """bf16 inputs take the C++ ops; fp32 inputs the reference, bit for bit."""
    from polyspec.backends.cpu.backend import CPUBackend
    from polyspec.kernels import reference as ref

    kernels = CPUBackend().kernels
    x32 = torch.randn(3, 64)
    w32 = torch.randn(64)
    assert same(kernels.rms_norm(x32, w32, 1e-6), ref.rms_norm(x32, w32, 1e-6))
    x16, w16 = x32.bfloat16(), w32.bfloat16()
    assert same(kernels.rms_norm(x16, w16, 1e-6), rowinv.rms_norm(x16, w16, 1e-6))
    assert same(kernels.silu_and_mul(x16), rowinv.silu_and_mul(x16))


def _count_cxx_calls(monkeypatch, name: str) -> list:
    """Load the extension (skip without it) and count the calls of ``rowinv.<name>``."""
    if rowinv.load() is None:
        pytest.skip(f"row-invariant cpu kernels unavailable: {rowinv.unavailable_reason()}")
    calls = []
    cxx = getattr(rowinv, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return cxx(*args, **kwargs)

    monkeypatch.setattr(rowinv, name, counted)
    return calls


def test_verify_tree_greedy_cxx_passes_the_conformance_fuzz(monkeypatch):
    """The cpu backend's C++ greedy verification (used once the extension is loaded) through
    the conformance suite's fuzz: random and corrupted trees, tiny vocabularies, compared with
    the reference and checked for the kernel's invariants."""
    from polyspec.backends.cpu.backend import CPUBackend
    from polyspec.testing.test_tree_fuzz import test_verify_tree_greedy_fuzz

    calls = _count_cxx_calls(monkeypatch, "verify_tree_greedy")
    test_verify_tree_greedy_fuzz(backend=CPUBackend())
    assert len(calls) > 10  # the fuzz ran through the C++ path


def test_build_tree_cxx_passes_the_conformance_tree_tests(monkeypatch):
    """The cpu backend's C++ tree build (used once the extension is loaded) through the
    conformance suite's fuzz (random, corrupted, duplicate-id trees, compared with the
    reference) and its golden trees."""
    from polyspec.backend import TreeMaskMode
    from polyspec.backends.cpu.backend import CPUBackend
    from polyspec.testing import test_tree_golden as golden
    from polyspec.testing.test_tree_fuzz import test_build_tree_fuzz, test_wide_tree

    calls = _count_cxx_calls(monkeypatch, "build_tree")
    backend = CPUBackend()
    test_build_tree_fuzz(backend=backend)
    for mode in TreeMaskMode:
        test_wide_tree(backend, mode)
        golden.test_chain(backend, mode)
        golden.test_topk_tree(backend, mode)
        golden.test_missing_parent(backend, mode)
    golden.test_parent_cycle_is_bounded(backend)
    golden.test_out_of_range_and_duplicate_ids(backend)
    assert len(calls) > 20  # the tests ran through the C++ path


def test_verify_tree_greedy_rejects_bad_index():
    if rowinv.load() is None:
        pytest.skip(f"row-invariant cpu kernels unavailable: {rowinv.unavailable_reason()}")
    z = torch.zeros(1, 3, dtype=torch.int64)
    bad = torch.tensor([[0, 1, 9]])
    with pytest.raises(RuntimeError, match="outside"):
        rowinv.verify_tree_greedy(
            z, bad, z - 1, z - 1, z, torch.zeros(3, dtype=torch.int64),
            torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
        )  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "mode", ["EXTEND", "DECODE", "TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE"]
)
def test_single_request_key_lists(mode, page_size):
    """A one-request batch's key lists (built directly, the batch-1 round's fast path) are
    each token's visible slots in attention order, exactly as the contract's oracle lists
    them; lane lengths only on the device send DRAFT_DECODE down the general path, same
    lists."""
    from polyspec.backend import ForwardBatch, ForwardMode
    from polyspec.backends.cpu.backend import CPUBackend
    from polyspec.testing.test_attention import (
        SlotSource,
        build_batch,
        make_requests,
        visible_slots,
    )

    gen = torch.Generator().manual_seed(page_size * 7 + len(mode))
    backend = CPUBackend()
    pool = backend.make_kv_pool(4096, 1, 2, 8, torch.bfloat16)
    attn = backend.make_attention(pool, 6, 2, 8, 0.35)
    m = ForwardMode[mode]
    source = SlotSource(page_size, gen)
    for prefix, extend in ((0, 7), (37, 1), (90, 6), (16, 3)):
        if m is ForwardMode.DECODE:
            extend = 1
        if m is ForwardMode.TARGET_VERIFY and prefix == 0:
            continue
        if m is ForwardMode.DRAFT_DECODE:
            reqs = make_requests([prefix], source, gen)
            width = 4
            lane_locs = torch.tensor([[source.take(width) for _ in range(extend)]])
            batch = ForwardBatch(
                mode=m,
                input_ids=torch.zeros(extend, dtype=torch.int64),
                positions=torch.full((extend,), prefix, dtype=torch.int64),
                out_cache_loc=lane_locs[0, :, 1],
                req_pool_indices=torch.tensor(reqs.rows),
                req_to_token=reqs.req_to_token,
                prefix_lens=torch.tensor([prefix]),
                extend_lens=torch.tensor([extend]),
                lane_locs=lane_locs,
                lane_lens=torch.tensor([2]),
                topk=extend,
            )
            batch.lane_lens_cpu = [2]
        else:
            reqs = make_requests([prefix + extend], source, gen)
            batch = build_batch(m, [prefix], [extend], reqs, gen, chain=False)
        want = visible_slots(batch)
        for host_lanes in (True, False):
            if not host_lanes:
                if m is not ForwardMode.DRAFT_DECODE:
                    continue
                batch.lane_lens_cpu = None  # the general path
            meta = attn.build_metadata(batch)
            ptr, idx = meta.kv_indptr.tolist(), meta.kv_indices.tolist()
            got = [idx[ptr[t] : ptr[t + 1]] for t in range(len(ptr) - 1)]
            assert got == want, (mode, prefix, extend, host_lanes)


# -- the weight-only int8 linear (rowinv.linear_w8) ----------------------------------------------


def _w8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from polyspec.kernels.quant import quantize_int8

    g = torch.Generator().manual_seed(seed)
    return quantize_int8(torch.randn(n, k, generator=g).bfloat16())


@pytest.mark.parametrize("k", [576, 13, 40])  # a multiple of both widths, and scalar tails
def test_linear_w8_matches_the_reference_on_each_path(isa, k):
    """fp32 sums of int8 x fp32 products: within a few fp32 ulps of the float64 product."""
    q, scale = _w8(70, k, 1)  # 70 = 17 groups of 4 columns and 2 left over
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(70, generator=g).bfloat16()
    for m in (1, 3, 5, 9):
        x = torch.randn(m, k, generator=g).bfloat16()
        y = rowinv.linear_w8(x, q, scale, bias, out_dtype=torch.float32)
        exact = (x.double() @ q.double().T) * scale.double() + bias.double()
        bound = 4 * k * 2**-24 * ((x.double().abs() @ q.double().abs().T) * scale.double()) + 1e-6
        assert ((y.double() - exact).abs() <= bound).all(), (isa, k, m)
        # bf16 output is the rounding of the fp32 one
        assert torch.equal(rowinv.linear_w8(x, q, scale, bias), y.bfloat16())


def test_linear_w8_is_row_invariant(isa):
    """A row's bits do not depend on the rows with it, its position, or the thread count."""
    q, scale = _w8(300, 576, 3)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    with num_threads(2):
        full = rowinv.linear_w8(x, q, scale, out_dtype=torch.float32)
    with num_threads(1):
        rows = [
            rowinv.linear_w8(x[i : i + 1], q, scale, out_dtype=torch.float32) for i in range(11)
        ]
        shuffled = rowinv.linear_w8(x.flip(0), q, scale, out_dtype=torch.float32).flip(0)
    assert torch.equal(torch.cat(rows), full)
    assert torch.equal(shuffled, full)


def test_linear_w8_takes_fp32_x():
    q, scale = _w8(40, 64, 5)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    y = rowinv.linear_w8(x, q, scale)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, (x.double() @ q.double().T * scale.double()).float())


def test_linear_w8_refuses_bad_arguments():
    q, scale = _w8(8, 32, 7)
    x = torch.randn(2, 32).bfloat16()
    with pytest.raises(RuntimeError, match="q must be a contiguous 2-D int8"):
        rowinv.linear_w8(x, q.float(), scale)
    with pytest.raises(RuntimeError, match="x is \\[2, 16\\] but q is"):
        rowinv.linear_w8(x[:, :16].contiguous(), q, scale)
    with pytest.raises(RuntimeError, match="scale must be a contiguous float32"):
        rowinv.linear_w8(x, q, scale[:4].contiguous())
    with pytest.raises(RuntimeError, match="bias must be"):
        rowinv.linear_w8(x, q, scale, torch.zeros(3))


def test_softmax_topk_takes_lower_ids_first_on_ties_and_checks_k():
    logits = torch.zeros(2, 20)
    logits[0, [3, 5, 7]] = 1.0
    p, idx = rowinv.softmax_topk(logits.bfloat16(), 4)
    assert idx.tolist() == [[3, 5, 7, 0], [0, 1, 2, 3]]
    torch.testing.assert_close(p, torch.softmax(logits, -1).gather(1, idx))
    with pytest.raises(RuntimeError, match="k must be in"):
        rowinv.softmax_topk(logits, 21)
    with pytest.raises(RuntimeError, match="logits must be a 2-D bfloat16 or float32"):
        rowinv.softmax_topk(logits.half(), 2)


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("hidden", [576, 13])
def test_rms_norm_is_the_serial_sum_of_squares_bit_for_bit(rows, hidden):
    """Rows' sums of squares advance together in vector lanes; each must still be the serial
    fp32 loop ss = ss + v * v (what a single row computes), so a row's bits never depend on the
    rows beside it."""
    import numpy as np

    g = torch.Generator().manual_seed(rows * 100 + hidden)
    x = (3 * torch.randn(rows, hidden, generator=g)).bfloat16()
    w = torch.randn(hidden, generator=g).bfloat16()
    want = []
    for row in x.float().numpy():
        ss = np.float32(0)
        for v in row:
            ss = np.float32(ss + np.float32(v * v))
        r = np.float32(1) / np.sqrt(np.float32(ss / np.float32(hidden) + np.float32(1e-5)))
        normed = torch.from_numpy(row * r).bfloat16().float()
        want.append((w.float() * normed).bfloat16())
    assert torch.equal(rowinv.rms_norm(x, w, 1e-5), torch.stack(want))


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_select_top_k_steps_equal_the_reference(index_dtype):
    """The C++ expansion step gives the reference's tensors exactly, with distinct scores."""
    from polyspec.kernels import reference

    g = torch.Generator().manual_seed(5)
    for bs, k, feat in [(1, 3, 576), (4, 2, 64), (3, 4, 16), (2, 1, 8)]:
        for step in (1, 2, 3):
            p = torch.rand(bs * k, k, generator=g)
            idx = torch.randint(0, 1000, (bs * k, k), generator=g).to(index_dtype)
            hidden = torch.randn(bs * k, feat, generator=g).bfloat16()
            scores = torch.rand(bs, k, generator=g)
            got = rowinv.select_top_k(step, p, idx, hidden, scores, k)
            want = reference.select_top_k(step, p, idx, hidden, scores, k)
            for a, b in zip([*got[:3], *got[3]], [*want[:3], *want[3]]):
                assert a.dtype == b.dtype and torch.equal(a, b), (bs, k, step)
    # ties: the lower candidate first
    p = torch.full((3, 3), 0.5)
    _, _, cs_p, level = rowinv.select_top_k(1, p, torch.zeros(3, 3, dtype=torch.int64),
                                            torch.zeros(3, 4), torch.ones(1, 3), 3)  # fmt: skip
    assert level[2].tolist() == [[3, 4, 5]] and cs_p.tolist() == [[0.5, 0.5, 0.5]]


def test_store_and_attend_equals_index_copy_then_attention():
    """One call (the cpu backend's per-layer store + attend) = index_copy_ into both caches,
    then rowinv.attention: the same bits, strided k/v views and int32 slots included; a slot
    outside the pool is an error before anything is written."""
    m = rowinv.load()
    g = torch.Generator().manual_seed(5)
    t, hq, hkv, d, slots = 3, 9, 3, 64, 40
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g).bfloat16()
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]  # strided, as in the model
    k_cache = torch.randn(slots, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(slots, hkv, d, generator=g).bfloat16()
    loc = torch.tensor([31, 7, 12], dtype=torch.int32)
    indptr = torch.tensor([0, 10, 21, 33])
    indices = torch.cat([torch.arange(10), torch.tensor([31] + list(range(10))), torch.arange(12)])
    k_want, v_want = k_cache.clone(), v_cache.clone()
    k_want.index_copy_(0, loc.long(), k)
    v_want.index_copy_(0, loc.long(), v)
    want = rowinv.attention(q.contiguous(), k_want, v_want, indptr, indices, 0.125)
    got = m.store_and_attend(q, k, v, k_cache, v_cache, loc, indptr, indices, 0.125)
    assert same(got, want) and same(k_cache, k_want) and same(v_cache, v_want)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="loc 40 outside the cache's 40 slots"):
        m.store_and_attend(
            q, k, v, k_cache, v_cache, torch.tensor([1, 2, 40]), indptr, indices, 0.1
        )
    assert same(k_cache, before)


def test_bound_linears_equal_the_plain_calls():
    """The cpu backend's per-weight callables (BoundLinear, BoundLinearW8): fn(x, bias) gives
    rowinv.linear / linear_w8's bits, for 2-D and batched x, with and without a bias."""
    from polyspec.kernels.quant import quantize_int8

    m = rowinv.load()
    w, b = bf16_rand(24, 40, seed=1), bf16_rand(24, seed=2)
    x = bf16_rand(2, 3, 40, seed=3)
    fn = m.BoundLinear(w)
    assert same(fn(x[0], None), rowinv.linear(x[0], w))
    assert same(fn(x[0], b), rowinv.linear(x[0], w, b))
    assert same(fn(x, b), rowinv.linear(x, w, b)) and fn(x, b).shape == (2, 3, 24)
    q, scale = quantize_int8(w)
    fn8 = m.BoundLinearW8(q, scale)
    assert same(fn8(x[1], b), rowinv.linear_w8(x[1], q, scale, b))
    assert same(fn8(x, None).reshape(6, 24), rowinv.linear_w8(x.reshape(6, 40), q, scale))
    with pytest.raises(RuntimeError, match="contiguous 2-D bfloat16"):
        m.BoundLinear(w.float())


def test_layer_op_entry_points_take_views_and_leading_dims():
    """The extension's own rms_norm / fused_add_rms_norm / silu_and_mul / rotary_embedding,
    which the cpu backend calls directly: strided inputs and [..., 2I] work, tuples come back."""
    from polyspec.kernels import reference

    m = rowinv.load()
    x = bf16_rand(4, 2, 48, seed=4)
    assert same(m.silu_and_mul(x), reference.silu_and_mul(x))
    h = bf16_rand(6, 64, seed=5)[:, :32]  # a strided view
    r, w = bf16_rand(6, 32, seed=6), bf16_rand(32, seed=7)
    normed, total = m.fused_add_rms_norm(h, r, w, 1e-5)
    assert same(total, h + r) and same(normed, m.rms_norm(total, w, 1e-5))
    q, k = bf16_rand(3, 4, 16, seed=8), bf16_rand(3, 2, 16, seed=9)
    from polyspec.model.rope import cos_sin_cache

    out = m.rotary_embedding(torch.tensor([0, 5, 9]), q, k, cos_sin_cache(16, 32, 10000.0))
    assert isinstance(out, tuple) and len(out) == 2
