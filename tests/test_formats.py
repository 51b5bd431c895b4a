"""rackbed.engine.core.formats: minifloat grids, exact round-to-nearest-even, MX / NVFP4 / FP8 / BF16 quantizers.

Properties (hypothesis): RNE equals a brute-force nearest search with ties to the even code; exactly
representable tensors round-trip exactly; error is bounded by the element's unit round-off times the block
scale (and saturated elements land exactly on the format max); zero blocks; NaN/Inf per the documented rules.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rackbed.engine.core.formats import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    EXTRA_FORMAT_NAMES,
    FORMAT_NAMES,
    MINIFLOATS,
    Minifloat,
    MxFormat,
    bf16_decode,
    bf16_encode,
    e8m0_decode,
    get_format,
    relative_error,
)

SETTINGS = settings(max_examples=100, deadline=None)
MX_NAMES = ("mxfp8", "mxfp6", "mxfp4", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp8_ceil")
SCALED_NAMES = ("fp8", "fp8_e5m2", "fp8_block", "nvfp4") + MX_NAMES


# ------------------------------------------------------------------------------------------------------------
# element formats
# ------------------------------------------------------------------------------------------------------------


def test_minifloat_grids_by_hand():
    assert E2M1.grid.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    # (max, smallest subnormal, number of non-negative finite codes, emax)
    expect = {
        E4M3: (448, 2**-9, 127, 8),
        E5M2: (57344, 2**-16, 124, 15),
        E2M3: (7.5, 0.125, 32, 2),
        E3M2: (28, 0.0625, 32, 4),
        E2M1: (6, 0.5, 8, 2),
    }
    for m, (mx, sub, n, emax) in expect.items():
        assert (m.max, m.grid[1], m.grid.size, m.emax) == (mx, sub, n, emax), m.name
    assert E4M3.nan_code == 0x7F and not E4M3.has_inf
    assert np.isposinf(E5M2.decode(np.uint8(0x7C))) and np.isnan(E5M2.decode(np.uint8(0x7D)))
    assert E4M3.decode(np.uint8(0x7E)) == 448 and E4M3.decode(np.uint8(0xFE)) == -448
    assert E4M3.decode(np.uint8(0x08)) == 2**-6  # smallest normal
    with pytest.raises(ValueError, match="no NaN"):
        _ = E2M1.nan_code


def _brute_rne(m: Minifloat, x: np.ndarray) -> np.ndarray:
    """Nearest grid value by exhaustive search; ties to the even code; beyond the max saturate."""
    g = m.grid
    a = np.minimum(np.abs(x), g[-1])
    d = np.abs(a[:, None] - g[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = d == best
    code = np.where(cand & (np.arange(g.size) % 2 == 0), np.arange(g.size), g.size).min(axis=1)
    code = np.where(code == g.size, cand.argmax(axis=1), code)
    return np.copysign(g[code], x)


@SETTINGS
@given(name=st.sampled_from(sorted(MINIFLOATS)), data=st.data())
def test_encode_is_round_to_nearest_even(name, data):
    m = MINIFLOATS[name]
    # values on the grid, exactly half-way between grid points (ties) and arbitrary values, all signs
    g = m.grid
    k = data.draw(st.lists(st.integers(0, g.size - 2), min_size=1, max_size=20))
    mids = (g[k] + g[np.array(k) + 1]) / 2
    free = data.draw(hnp.arrays(np.float64, 20, elements=st.floats(-2 * m.max, 2 * m.max)))
    x = np.concatenate([g[k], mids, free]) * data.draw(st.sampled_from([1.0, -1.0]))
    got = m.round(x)
    np.testing.assert_array_equal(got, _brute_rne(m, x))
    # ties went to the even code
    codes = m.encode(mids) & ((1 << (m.bits - 1)) - 1)
    assert np.all(codes % 2 == 0)


def test_encode_saturation_and_specials():
    assert E2M1.round(np.array([7.9, -100.0, 5.0, 5.01])).tolist() == [6, -6, 4, 6]  # 5 is a tie -> 4 (even)
    assert E4M3.round(np.array([np.inf, -np.inf])).tolist() == [448, -448]  # satfinite
    assert np.isnan(E4M3.round(np.array([np.nan]))).all()
    # non-saturating: E5M2 overflows to inf at the half-ulp tie (57344 + 4096); E4M3 to NaN after 464
    r = E5M2.round(np.array([61439.0, 61440.0, 1e9]), saturate=False)
    assert r[0] == 57344 and np.isposinf(r[1]) and np.isposinf(r[2])
    r = E4M3.round(np.array([464.0, 464.5]), saturate=False)
    assert r[0] == 448 and np.isnan(r[1])
    with pytest.raises(ValueError, match="cannot encode NaN"):
        E2M1.encode(np.array([np.nan]))
    assert E4M3.encode(np.array([-0.0]))[0] == 0x80  # the sign of zero is kept


def test_bf16_round_to_nearest_even_by_hand():
    ulp = 2.0**-7
    x = np.array([1 + ulp / 2, 1 + 1.5 * ulp, 1 + 0.75 * ulp, 3.4e38, -2.5, np.inf, -np.inf], np.float32)
    got = bf16_decode(bf16_encode(x))
    assert got[:3].tolist() == [1.0, 1 + 2 * ulp, 1 + ulp]
    assert np.isposinf(got[3])  # above bf16 max -> inf (IEEE RNE overflow)
    assert got[4] == -2.5 and np.isposinf(got[5]) and np.isneginf(got[6])
    assert np.isnan(bf16_decode(bf16_encode(np.array([np.nan, -np.nan], np.float32)))).all()


@SETTINGS
@given(bits=hnp.arrays(np.uint16, 64))
def test_bf16_codes_round_trip(bits):
    vals = bf16_decode(bits)
    back = bf16_encode(vals)
    finite = ~np.isnan(vals)
    np.testing.assert_array_equal(back[finite], bits[finite])
    assert np.isnan(bf16_decode(back[~finite])).all()


def test_e8m0_decode():
    got = e8m0_decode(np.array([0, 127, 130, 254, 255], np.uint8))
    assert got[:4].tolist() == [2.0**-127, 1.0, 8.0, 2.0**127] and np.isnan(got[4])


# ------------------------------------------------------------------------------------------------------------
# formats
# ------------------------------------------------------------------------------------------------------------


def test_bytes_per_element_by_hand():
    expect = {  # (weight, activation)
        "bf16": (2, 2),
        "fp8": (1, 1),
        "fp8_block": (1 + 4 / 128**2, 1 + 4 / 128),
        "mxfp8": (1 + 1 / 32,) * 2,
        "mxfp6": (0.75 + 1 / 32,) * 2,
        "mxfp4": (0.5 + 1 / 32,) * 2,
        "nvfp4": (0.5 + 1 / 16,) * 2,
    }
    assert set(expect) == set(FORMAT_NAMES)
    for name, (w, a) in expect.items():
        f = get_format(name)
        assert f.bytes_per_element() == w == f.bytes_per_element("weight"), name
        assert f.bytes_per_element("activation") == a, name


@pytest.mark.parametrize("name", FORMAT_NAMES + EXTRA_FORMAT_NAMES)
@pytest.mark.parametrize("role", ["weight", "activation"])
def test_storage_matches_bytes_per_element(name, role):
    f = get_format(name)
    x = np.random.default_rng(1).standard_normal((256, 512))
    q = f.quantize(x, role)
    assert q.codes.shape == x.shape and q.format == name
    per_tensor = 4 if q.tensor_scale is not None else 0  # one fp32 per tensor, not in bytes_per_element
    assert q.nbytes - per_tensor == pytest.approx(f.bytes_per_element(role) * x.size, rel=1e-12)


def test_errors_are_one_line_value_errors():
    with pytest.raises(ValueError, match="unknown numeric format 'fp7'.*mxfp4"):
        get_format("fp7")
    with pytest.raises(ValueError, match="role"):
        get_format("mxfp8").quantize(np.ones(4), role="kv")
    with pytest.raises(ValueError, match="cannot dequantize"):
        get_format("mxfp4").dequantize(get_format("mxfp8").quantize(np.ones(4)))


def test_mx_scale_by_hand():
    # amax 1.0: floor(log2 1) = 0 -> X = -emax_elem
    for name, x_exp in [("mxfp8", -8), ("mxfp6", -2), ("mxfp4", -2), ("mxfp8_e5m2", -15), ("mxfp6_e3m2", -4)]:
        q = get_format(name).quantize(np.linspace(-1, 1, 32))
        assert q.scale_codes.tolist() == [127 + x_exp], name
    # E2M1: amax 7.5 -> X = 2 - 2 = 0 and 7.5 clips to 6 (OCP rule); the ceil rule would use X = 1 instead
    x = np.array([7.5, 5.0, 1.25, -0.25] + [0.0] * 28)
    q = get_format("mxfp4").quantize(x)
    assert q.scale_codes.tolist() == [127]
    assert get_format("mxfp4").dequantize(q)[:4].tolist() == [6.0, 4.0, 1.0, -0.0]  # 5 and 1.25 are ties
    ceil = MxFormat("t", E2M1, scale_rule="ceil")
    assert ceil.quantize(x).scale_codes.tolist() == [128]


def test_mx_blocks_tensors_of_any_shape():
    x = np.random.default_rng(2).standard_normal((3, 5, 70))  # 70 = 2 full blocks + 6
    for name in MX_NAMES:
        f = get_format(name)
        q = f.quantize(x)
        assert q.scales.shape == (3, 5, 3)
        y = f.dequantize(q)
        assert y.shape == x.shape
        # each block is quantized independently: the padded tail equals quantizing it alone
        np.testing.assert_array_equal(y[..., 64:], f.roundtrip(x[..., 64:]))
    assert get_format("mxfp4").roundtrip(np.float64(3.0)).shape == ()


def test_fp8_block_tiles_and_scales():
    f = get_format("fp8_block")
    rng = np.random.default_rng(3)
    w = rng.standard_normal((200, 300)) * np.exp(rng.standard_normal((200, 1)))
    q = f.quantize(w, "weight")
    assert q.scales.shape == (2, 3)
    tile_amax = np.abs(w[128:, 256:]).max()
    assert q.scales[1, 2] == np.float32(tile_amax / 448)
    a = f.quantize(w, "activation")
    assert a.scales.shape == (200, 3)
    assert a.scales[7, 1] == np.float32(np.abs(w[7, 128:256]).max() / 448)
    for qt in (q, a):
        y = f.dequantize(qt)
        assert y.shape == w.shape
        assert np.max(np.abs(y - w)) <= np.max(np.abs(w)) * 2**-4
    v = f.quantize(np.arange(5.0) * 112, "weight")  # 1-D weight = one row; amax 448 -> scale 1
    # 336 is half-way between 320 (mantissa 010) and 352 (011): ties to even -> 320
    assert v.scales.shape == (1, 1) and f.dequantize(v).tolist() == [0, 112, 224, 320, 448]


def test_nvfp4_by_hand():
    f = get_format("nvfp4")
    # tensor amax 6 * 448 -> s_t = 1; block 0 amax 6 -> s_b = E4M3(1) = 1; block 1 amax 3 -> s_b = 0.5
    x = np.zeros(48)
    x[0], x[1], x[2] = 6 * 448, 448, -0.1
    x[16], x[17] = 6.0, 2.9
    x[32], x[33] = 3.0, 0.4
    q = f.quantize(x)
    assert q.tensor_scale == 1.0
    assert q.scales.tolist() == [448.0, 1.0, 0.5]
    y = f.dequantize(q)
    assert y[[0, 1, 2, 16, 17, 32, 33]].tolist() == [2688, 448, -0.0, 6, 3, 3, 0.5]


# ------------------------------------------------------------------------------------------------------------
# properties of the quantizers
# ------------------------------------------------------------------------------------------------------------


@SETTINGS
@given(name=st.sampled_from(MX_NAMES), data=st.data())
def test_mx_exactly_representable_round_trip(name, data):
    f = get_format(name)
    m = f.elem
    n_blocks = data.draw(st.integers(1, 4))
    codes = data.draw(hnp.arrays(np.uint8, (n_blocks, 32), elements=st.integers(0, 2 * m.grid.size - 1)))
    codes = np.where(codes >= m.grid.size, (codes - m.grid.size) | (1 << (m.bits - 1)), codes).astype(
        np.uint8
    )
    exps = np.array(data.draw(st.lists(st.integers(-110, 110), min_size=n_blocks, max_size=n_blocks)))
    xb = np.ldexp(m.decode(codes), exps[:, None])  # each block: grid values x 2**X
    y = f.roundtrip(xb.reshape(-1)).reshape(xb.shape)
    # The OCP scale puts a block's amax into [2**emax, 2**(emax+1)); only E4M3 has top-binade values above its
    # max there (1.875 * 256 = 480 > 448): those clip to ±448 * 2**X', everything else round-trips exactly.
    amax = np.abs(xb).max(axis=1, keepdims=True)
    top = np.ldexp(1.0, np.frexp(amax)[1] - 1 - m.emax)  # 2**X' (OCP) for nonzero blocks
    over = (np.abs(xb) / np.where(amax > 0, top, 1.0) > m.max) & (f.scale_rule == "ocp")
    np.testing.assert_array_equal(y[~over], xb[~over])
    np.testing.assert_array_equal(
        y[over], np.copysign(m.max, xb[over]) * np.broadcast_to(top, xb.shape)[over]
    )
    if m is not E4M3:
        assert not over.any()


@SETTINGS
@given(name=st.sampled_from(["fp8", "fp8_e5m2", "fp8_block", "nvfp4"]), data=st.data())
def test_fp32_scaled_exactly_representable_round_trip(name, data):
    """Tensors built so that every scale comes out a power of two (fp8) or an exact E4M3 value (nvfp4)."""
    f = get_format(name)
    k = data.draw(st.integers(-30, 30))
    if name == "nvfp4":
        e2m1 = np.asarray(E2M1.grid)
        sb = data.draw(hnp.arrays(np.float64, 3, elements=st.sampled_from(E4M3.grid[1:].tolist())))
        sb[0] = 448.0  # makes the tensor amax 6 * 448 * 2**k -> s_t = 2**k exactly
        vals = data.draw(
            hnp.arrays(np.float64, (3, 16), elements=st.sampled_from((e2m1 * [[1], [-1]]).ravel().tolist()))
        )
        vals[:, 0] = 6.0  # every block holds its max -> s_b exact
        x = np.ldexp(vals * sb[:, None], k).reshape(-1)
    else:
        m = f.elem
        g = np.concatenate([m.grid, -m.grid])
        x = data.draw(
            hnp.arrays(
                np.float64, (128, 128) if name == "fp8_block" else 300, elements=st.sampled_from(g.tolist())
            )
        )
        x.flat[0] = m.max  # amax = max * 2**k -> scale 2**k exactly
        x = np.ldexp(x, k)
    np.testing.assert_array_equal(f.roundtrip(x), x)


finite_tensors = hnp.arrays(
    np.float64,
    st.tuples(st.integers(1, 3), st.integers(1, 100)),
    elements=st.one_of(
        st.floats(-(2.0**14), 2.0**14, width=32),
        st.floats(-(2.0**-10), 2.0**-10, width=32),
        st.sampled_from([0.0, 1e-30, -3e3, 7.5, 0.5]),
    ),
)


def _effective_scales(name: str, q, shape) -> np.ndarray:
    """The scale each element was divided by, broadcast to the tensor shape."""
    f = get_format(name)
    if q.scales is None:
        return np.full(shape, q.tensor_scale)
    if name == "fp8_block":
        ones = np.ones(shape)
        return f._untile(f._tiles(ones, q.role) * q.scales[..., None, None], shape, q.role)
    s = q.scales * (q.tensor_scale if q.tensor_scale is not None else 1.0)
    return np.repeat(s, f.block, axis=-1)[..., : shape[-1]]


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(SCALED_NAMES), x=finite_tensors, role=st.sampled_from(["weight", "activation"]))
def test_error_bounded_by_unit_roundoff_times_scale(name, x, role):
    """|x - q| <= u * max(|x|, 2**emin * s), unless |x| / s exceeds the max: then q = ±max * s exactly."""
    f = get_format(name)
    q = f.quantize(x, role)
    y = f.dequantize(q)
    s = _effective_scales(name, q, x.shape)
    m = f.elem
    assert np.all(np.isfinite(y))
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(s > 0, np.abs(x) / s, 0.0)
    sat = a >= m.max
    np.testing.assert_allclose(y[sat], np.copysign(m.max * s[sat], x[sat]), rtol=1e-12)
    bound = m.unit_roundoff * np.maximum(np.abs(x), np.ldexp(s, m.emin)) * (1 + 1e-9)
    live = ~sat & (s > 0)
    assert np.all(np.abs(x - y)[live] <= bound[live])
    assert np.all(y[s == 0] == 0)  # a block scale that underflowed to 0 (nvfp4) stores zeros
    if name in ("fp8", "fp8_e5m2", "fp8_block", "mxfp8_ceil"):
        # these scale rules never clip beyond the fp32 rounding of the scale: half an fp32 ulp of s (2^-24 relative
        # for a normal fp32 scale; more where amax / max is an fp32 subnormal, e.g. 6.6e-36 in E5M2)
        rel = np.where(s > 0, np.spacing(np.abs(s).astype(np.float32)).astype(np.float64) / np.where(s > 0, s, 1), 0)
        assert not np.any(a > m.max * (1 + np.maximum(rel, 1e-6)))


@pytest.mark.parametrize("name", FORMAT_NAMES + EXTRA_FORMAT_NAMES)
def test_zero_blocks(name):
    f = get_format(name)
    x = np.zeros((4, 256))
    x[1, :] = np.linspace(-3, 3, 256)
    q = f.quantize(x)
    y = f.dequantize(q)
    assert np.all(y[[0, 2, 3]] == 0) and not np.isnan(y).any()
    if name in MX_NAMES:
        assert np.all(q.scale_codes[0] == 0)  # smallest E8M0 scale, not NaN
    z = f.dequantize(f.quantize(np.zeros(64)))
    assert np.all(z == 0)


@pytest.mark.parametrize("name", MX_NAMES + ("nvfp4",))
@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_mx_nan_inf_poison_only_their_block(name, special):
    f = get_format(name)
    x = np.random.default_rng(4).standard_normal(4 * f.block)
    x[f.block + 3] = special
    q = f.quantize(x)
    y = f.dequantize(q)
    bad = slice(f.block, 2 * f.block)
    assert np.isnan(y[bad]).all()
    nan_code = 0xFF if name != "nvfp4" else 0x7F
    assert q.scale_codes.tolist().count(nan_code) == 1 and q.scale_codes[1] == nan_code
    clean = np.delete(np.arange(x.size), np.arange(f.block, 2 * f.block))
    assert not np.isnan(y[clean]).any()
    if name != "nvfp4":  # MX blocks are independent; nvfp4's tensor scale uses the finite amax
        np.testing.assert_array_equal(y[: f.block], f.roundtrip(x[: f.block]))


def test_fp8_and_bf16_nan_inf():
    for name in ("fp8", "fp8_block"):
        f = get_format(name)
        x = np.array([1.0, -2.0, np.nan, np.inf, -np.inf, 448.0] + [0.5] * 10)
        q = f.quantize(x, "activation")
        y = f.dequantize(q)
        s = 448.0 / 448  # scale from the finite amax
        assert np.isnan(y[2]) and y[3] == 448 * s and y[4] == -448 * s and y[0] == 1.0
    y = get_format("bf16").roundtrip(np.array([np.nan, np.inf, -np.inf, 1.0]))
    assert np.isnan(y[0]) and np.isposinf(y[1]) and np.isneginf(y[2]) and y[3] == 1.0


def test_relative_error_orders_the_formats():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 1024))
    t = rng.standard_t(3, size=(64, 1024))
    err = {n: relative_error(x, n) for n in FORMAT_NAMES}
    assert err["bf16"] < 2**-8
    assert err["bf16"] < err["fp8"] < err["mxfp4"]
    assert err["mxfp6"] < err["nvfp4"] < err["mxfp4"]
    assert relative_error(t, "nvfp4") < relative_error(t, "mxfp4")  # finer scales help heavy tails
    assert relative_error(t, "mxfp8_ceil") < relative_error(t, "mxfp8")  # OCP rule clips the top binade
    assert relative_error(np.zeros(8), "mxfp4") == 0.0


# ------------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------------


def test_cli_formats_table(capsys):
    from rackbed.engine.cli.main import main

    assert main(["formats", "--rows", "8", "--cols", "512"]) == 0
    out = capsys.readouterr().out
    for name in FORMAT_NAMES:
        assert name in out
    assert "0.5312" in out and "1.0312" in out  # mxfp4 / mxfp8 bytes per element


def test_cli_formats_json_and_errors(capsys):
    from rackbed.engine.cli.main import main

    assert main(["formats", "--rows", "4", "--cols", "256", "--json", "--all"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(FORMAT_NAMES + EXTRA_FORMAT_NAMES)
    assert all(0 <= r["rel_err_gaussian"] < 0.2 and math.isfinite(r["rel_err_student_t"]) for r in rows)
    assert main(["formats", "--rows", "0"]) == 2
    assert "--rows" in capsys.readouterr().err



@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2", "fp8_block"])
@pytest.mark.parametrize("v", [6.59154081e-36, 1e-40, 3.3e-39, 1.0])
def test_fp32_scale_clips_at_most_by_its_rounding(name, v):
    """scale = fp32(amax / max), rounded to nearest as torch / real engines do: amax / scale exceeds the element max
    by at most half an fp32 ulp of the scale (found by hypothesis: 6.6e-36 in E5M2, a subnormal scale, is 1.2e-6
    over), and the element then saturates at the max."""
    f = get_format(name)
    x = np.full((2, 256), v)
    q = f.quantize(x, "weight")
    s = _effective_scales(name, q, x.shape)
    ulp = np.spacing(s.astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(x) <= (f.elem.max * (s + ulp / 2)) * (1 + 1e-12))
    assert np.all(np.abs(f.dequantize(q)) <= f.elem.max * s)
