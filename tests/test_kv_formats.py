"""DeepSeek-V4.1's quantized KV-cache formats: each QDQ is bit-identical to DeepSeek's own kernels (the
vendored CPU ports in `reference/deepseek_v41/kernel_cpu.py`), the packed codecs hold exactly the kernels'
quantized codes and scales, and decoding what was encoded gives exactly the QDQ values."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from openinfer.quantization.kv_formats import (Fp4BlockCodec, Fp8BlockCodec, Fp8DsMlaCodec, IdentityCodec, fp4_block_qdq,
                                               fp8_block_qdq)

SHARED_DIR = Path(__file__).resolve().parents[2] / "shared"
REFERENCE_DIR = SHARED_DIR / "reference" / "deepseek_v41"

# (group, scale format): compressed KV, indexer, and the two other combinations
FP4_CASES = [(16, "e4m3"), (32, "e8m0"), (32, "e4m3"), (16, "e8m0")]
SCALE_DTYPES = {"e8m0": torch.float8_e8m0fnu, "e4m3": torch.float8_e4m3fn}


@pytest.fixture(scope="module")
def kernel_cpu():
    if not (REFERENCE_DIR / "kernel_cpu.py").is_file():
        pytest.skip(f"the vendored DeepSeek reference is not at {REFERENCE_DIR}: reference comparison skipped")
    if str(SHARED_DIR) not in sys.path:
        sys.path.insert(0, str(SHARED_DIR))
    from reference.deepseek_v41 import kernel_cpu
    return kernel_cpu


def _groups(rows: list[list[float]], width: int) -> torch.Tensor:
    """Each row of values, zero-padded to `width`."""
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r)
    return out


def hard_inputs(dim: int = 128) -> torch.Tensor:
    """bf16 [rows, dim]: every row hits some edge of the formats (group size 16 or 32 divides dim)."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(4, dim, generator=g) * 10.0**k for k in range(-6, 4)]
    rows.append(torch.randn(4, dim, generator=g) * 1e-39)                       # bf16 subnormals
    rows.append(torch.zeros(2, dim))                                            # all-zero groups
    rows.append(torch.full((1, dim), -0.0))                                     # negative zeros
    tiny_neg = torch.randn(1, dim, generator=g).abs() * -1e-3
    tiny_neg[0, ::16] = -40.0                                                   # negatives that round to -0
    rows.append(tiny_neg)
    # E2M1 ties at scale 1 (amax 6 in every group of 16): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, ...
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    rows.append(torch.tensor(ties).repeat(dim // 16)[None])
    rows.append(torch.tensor(ties).repeat(dim // 16)[None] * 2.0**-20)
    rows.append(torch.tensor(ties).repeat(dim // 16)[None] * 2.0**40)
    # E4M3 ties: FP8 values at scale 0.5 (amax 200): 2.125 / 0.5 = 4.25 (tie -> 4), 2.375 / 0.5 = 4.75 (-> 5);
    # FP4 E4M3 scales amax / 6 = 1.0625 (tie -> 1.0, so 6.375 saturates at 6) and 1.1875 (tie -> 1.25)
    rows.append(_groups([[200.0, 2.125, 2.375, -2.125, -2.375, 6.375, 7.125, 0.0078125] * (dim // 8)], dim))
    rows.append(_groups([[6.375, 3.1875, 1.0625] + [0.5] * 13 + [7.125, 3.5625, -1.1875] + [0.25] * 13], dim))
    # past saturation: near the bf16 maximum, huge next to tiny, and a group whose amax scale rounds down
    sat = torch.randn(2, dim, generator=g)
    sat[0, ::3] = 3.0e38
    sat[1, 1::5] = -1.0e30
    rows.append(sat)
    # a mix: every group of 16 at its own scale
    mix = torch.randn(3, dim, generator=g) * (10.0 ** torch.randint(-8, 6, (3, dim // 16, 1), generator=g)
                                              ).repeat_interleave(16, -1).flatten(-2)
    mix[0, :16] = 0.0
    mix[1, 16:32] = -0.0
    rows.append(mix)
    return torch.cat(rows).to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} values differ, first at {diff[0].tolist()}: {a[tuple(diff[0])]} vs " \
                              f"{b[tuple(diff[0])]}"


# ---- bit-identical to DeepSeek's kernels ------------------------------------------------------------------
def test_inputs_cover_the_edges():
    x = hard_inputs()
    assert torch.isfinite(x).all()
    assert (torch.signbit(x) & (x == 0)).any()


@pytest.mark.parametrize("block", [32, 128])
def test_fp8_qdq_matches_reference(kernel_cpu, block):
    x = hard_inputs()
    ref = kernel_cpu.act_quant(x.clone(), block, "ue8m0", torch.float8_e8m0fnu, inplace=True)
    out = fp8_block_qdq(x, block)
    assert out.dtype == torch.bfloat16
    assert_bits_equal(out, ref)


@pytest.mark.parametrize("group,scale_fmt", FP4_CASES)
def test_fp4_qdq_matches_reference(kernel_cpu, group, scale_fmt):
    x = hard_inputs()
    ref = kernel_cpu.fp4_act_quant(x.clone(), group, True, scale_dtype=SCALE_DTYPES[scale_fmt])
    out = fp4_block_qdq(x, group, scale_fmt)
    assert out.dtype == torch.bfloat16
    assert_bits_equal(out, ref)


def test_fp8_encode_holds_the_reference_codes_and_scales(kernel_cpu):
    x = hard_inputs()
    q, s = kernel_cpu.act_quant(x.clone(), 32, "ue8m0", torch.float8_e8m0fnu)
    stored = Fp8BlockCodec(32).encode(x)
    assert stored.dtype == torch.uint8 and stored.shape == (x.shape[0], 128 + 4)
    assert torch.equal(stored[:, :128], q.view(torch.uint8))
    assert torch.equal(stored[:, 128:], s.view(torch.uint8))


@pytest.mark.parametrize("group,scale_fmt", FP4_CASES)
def test_fp4_encode_holds_the_reference_codes_and_scales(kernel_cpu, group, scale_fmt):
    x = hard_inputs()
    packed, s = kernel_cpu.fp4_act_quant(x.clone(), group, False, scale_dtype=SCALE_DTYPES[scale_fmt])
    stored = Fp4BlockCodec(group, scale_fmt).encode(x)
    assert stored.dtype == torch.uint8 and stored.shape == (x.shape[0], 64 + 128 // group)
    assert torch.equal(stored[:, :64], packed.view(torch.uint8))
    assert torch.equal(stored[:, 64:], s.view(torch.uint8))


# ---- codecs: decode(encode(x)) == qdq(x) ------------------------------------------------------------------
CODECS = [Fp8BlockCodec(32), Fp8BlockCodec(128)] + [Fp4BlockCodec(g, f) for g, f in FP4_CASES] + [
    Fp8DsMlaCodec(), Fp8DsMlaCodec(rope_dim=16, tile=16)]


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_equals_qdq(codec, dtype):
    x = hard_inputs().to(dtype)
    if dtype == torch.float32:      # values bf16 cannot hold as well
        x = torch.cat([x, torch.randn(8, 128, generator=torch.Generator().manual_seed(1)) * 37.1])
    stored = codec.encode(x)
    assert stored.dtype == codec.storage_dtype and stored.shape == (x.shape[0], codec.stored_dim(128))
    out = codec.decode(stored, dtype)
    assert out.dtype == dtype
    assert_bits_equal(out, codec.qdq(x))


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_float32_qdq_rounds_to_the_bf16_qdq(codec):
    """float32 QDQ is the same arithmetic without the final bf16 rounding."""
    x = hard_inputs()
    out32 = codec.qdq(x.float())
    assert out32.dtype == torch.float32
    assert_bits_equal(out32.to(torch.bfloat16), codec.qdq(x))


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_decode_gathered_rows_of_any_shape(codec):
    x = hard_inputs()[:24].view(2, 3, 4, 128)
    stored = codec.encode(x)
    assert stored.shape == (2, 3, 4, codec.stored_dim(128))
    idx = torch.tensor([[5, 0], [23, 7], [7, 11]])
    gathered = stored.view(-1, stored.shape[-1])[idx]            # [3, 2, stored_dim], as from a block table
    assert_bits_equal(codec.decode(gathered, torch.bfloat16), codec.qdq(x).view(-1, 128)[idx])
    strided = stored[:, ::2, 1]                                  # a non-contiguous view
    assert_bits_equal(codec.decode(strided, torch.float32), codec.qdq(x)[:, ::2, 1].float())
    one = codec.encode(x[0, 0, 0])                               # a single 1-D entry
    assert_bits_equal(codec.decode(one, torch.bfloat16), codec.qdq(x[0, 0, 0]))


def test_fp4_packing_layout():
    """Two E2M1 codes per byte, even element in the low nibble; E8M0 byte = biased exponent."""
    x = torch.zeros(32)
    x[:4] = torch.tensor([0.5, -1.0, 6.0, -0.0])
    stored = Fp4BlockCodec(32, "e8m0").encode(x)
    assert stored.shape == (17,)
    assert stored[:2].tolist() == [0b1010_0001, 0b1000_0111]
    assert stored[16].item() == 127                                     # scale 1 (amax 6)
    stored = Fp4BlockCodec(16, "e4m3").encode(x * 4)                    # amax 24: E4M3 scale 4.0
    assert stored[16:].tolist() == [torch.tensor(4.0).to(torch.float8_e4m3fn).view(torch.uint8).item(), 1]
    assert stored[0].item() == 0b1010_0001


def test_fp8_layout():
    x = torch.zeros(64)
    x[0], x[1], x[32] = 448.0, -1.0, 1e-6
    stored = Fp8BlockCodec(32).encode(x)
    assert stored.shape == (66,)
    assert stored[0].item() == torch.tensor(448.0).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert stored[64].item() == 127                                     # 448 * fp32(1/448) -> 2^0
    assert stored[65].item() == 127 - 22                                # amax floored at 1e-4 -> 2^-22


# ---- DeepSeek-V4's FlashMLA rows (kv_cache_dtype="fp8_ds_mla") ------------------------------------------------
def test_ds_mla_layout_bit_by_bit():
    """One hand-made V4 entry: NoPE E4M3 bytes, then the RoPE part's bf16 bits little-endian, then the 7 E8M0 bytes
    and one zero pad byte (FlashMLA MODEL1_FP8Sparse, page_block_size 1)."""
    x = torch.zeros(512)
    x[0], x[1], x[64], x[447] = 448.0, -3.0, 1e-6, 0.75     # tiles 0, 1 and 6
    x[448], x[449], x[511] = 1.0, -2.5, 3.140625            # RoPE part (exact in bf16: 0x3F80, 0xC020, 0x4049)
    row = Fp8DsMlaCodec().encode(x)
    assert row.dtype == torch.uint8 and row.shape == (584,)
    assert row[0].item() == 0x7E and row[1].item() == 0xC4   # 448 = 1.75 * 2^8, -3 = -1.5 * 2^1 (scale 2^0)
    assert row[64].item() == 0x48                            # 1e-6 / 2^-22 = 4.19 -> 4.0 (amax floored at 1e-4)
    assert row[447].item() == 0x7C                           # 0.75 / 2^-9 = 384 = 1.5 * 2^8
    assert row[448:450].tolist() == [0x80, 0x3F] and row[450:452].tolist() == [0x20, 0xC0]
    assert row[574:576].tolist() == [0x49, 0x40]
    assert row[576:583].tolist() == [127, 127 - 22, 127 - 22, 127 - 22, 127 - 22, 127 - 22, 127 - 9]
    assert row[583].item() == 0


def test_ds_mla_rows_are_flashmla_model1_with_one_token_pages():
    """An independent writer of FlashMLA's MODEL1 page layout (a page of P tokens: P x 576 value bytes, then P x 8
    scale bytes; deepseek-ai/FlashMLA tests/quant.py, csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh) with P = 1 and
    the same scales gives our rows byte for byte, and FlashMLA's bf16 dequantization (value * scale in bf16) our
    decode."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 512, generator=g) * torch.logspace(-3, 2, 6)[:, None]).bfloat16()
    codec = Fp8DsMlaCodec()
    rows = codec.encode(x)
    for t in range(6):
        page = torch.zeros(584, dtype=torch.uint8)
        for i in range(7):
            tile = x[t, 64 * i:64 * (i + 1)].float()
            scale = 2.0 ** math.ceil(math.log2(max(tile.abs().max().item(), 1e-4) * (1 / 448)))
            page[64 * i:64 * (i + 1)] = (tile / scale).to(torch.float8_e4m3fn).view(torch.uint8)
            page[576 + i] = int(round(math.log2(scale))) + 127
        page[448:576] = x[t, 448:].view(torch.uint8)
        assert torch.equal(rows[t], page), t
        nope = page[:448].view(torch.float8_e4m3fn).to(torch.bfloat16).view(7, 64)
        scales = page[576:583].view(torch.float8_e8m0fnu).to(torch.bfloat16)
        flashmla = torch.cat(((nope * scales[:, None]).flatten(), page[448:576].view(torch.bfloat16)))
        assert torch.equal(codec.decode(rows[t], torch.bfloat16), flashmla)


def test_ds_mla_sizes_and_tiles():
    assert Fp8DsMlaCodec().stored_dim(512) == 584 and Fp8DsMlaCodec().dim_of(584) == 512
    assert Fp8DsMlaCodec.for_head(512, 64) == Fp8DsMlaCodec(64, 64)
    assert Fp8DsMlaCodec.for_head(32, 8) == Fp8DsMlaCodec(8, 8)        # the tiny V4: 24 NoPE values, 3 tiles
    assert Fp8DsMlaCodec(8, 8).stored_dim(32) == 24 + 16 + 8
    with pytest.raises(ValueError, match="100.*64"):
        Fp8DsMlaCodec().stored_dim(164)
    with pytest.raises(ValueError, match="583"):
        Fp8DsMlaCodec().decode(torch.zeros(583, dtype=torch.uint8), torch.bfloat16)
    with pytest.raises(ValueError, match="no NoPE"):
        Fp8DsMlaCodec().encode(torch.zeros(64))


# ---- sizes and validation ---------------------------------------------------------------------------------
def test_stored_dims():
    assert Fp8BlockCodec().stored_dim(512) == 528                 # sliding-window KV
    assert Fp4BlockCodec(16, "e4m3").stored_dim(512) == 288       # compressed KV
    assert Fp4BlockCodec(32, "e8m0").stored_dim(128) == 68        # indexer keys
    assert IdentityCodec(torch.bfloat16).stored_dim(512) == 512
    assert Fp8BlockCodec().storage_dtype == Fp4BlockCodec(16, "e4m3").storage_dtype == torch.uint8
    assert IdentityCodec(torch.bfloat16).storage_dtype == torch.bfloat16


def test_identity_codec():
    codec = IdentityCodec(torch.bfloat16)
    x = torch.randn(3, 8)
    stored = codec.encode(x)
    assert stored.dtype == torch.bfloat16
    assert torch.equal(codec.decode(stored, torch.float32), x.bfloat16().float())
    assert torch.equal(codec.qdq(x), x.bfloat16().float())


def test_bad_dims_are_rejected():
    with pytest.raises(ValueError, match="100.*32"):
        Fp8BlockCodec(32).stored_dim(100)
    with pytest.raises(ValueError, match="100.*32"):
        Fp8BlockCodec(32).encode(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="40.*16"):
        Fp4BlockCodec(16, "e4m3").encode(torch.zeros(40))
    with pytest.raises(ValueError, match="48.*32"):
        Fp4BlockCodec(32, "e8m0").stored_dim(48)
    with pytest.raises(ValueError, match="40.*16"):
        fp4_block_qdq(torch.zeros(40), 16, "e4m3")
    with pytest.raises(ValueError, match="100.*32"):
        fp8_block_qdq(torch.zeros(100))
    with pytest.raises(ValueError, match="67"):
        Fp8BlockCodec(32).decode(torch.zeros(67, dtype=torch.uint8), torch.bfloat16)
    with pytest.raises(ValueError, match="35"):
        Fp4BlockCodec(32, "e8m0").decode(torch.zeros(35, dtype=torch.uint8), torch.bfloat16)
    with pytest.raises(ValueError, match="ue8m0"):
        Fp4BlockCodec(32, "ue8m0")
    with pytest.raises(ValueError, match="15"):
        Fp4BlockCodec(15, "e8m0")
