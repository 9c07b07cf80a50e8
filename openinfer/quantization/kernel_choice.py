"""Which kernel runs a quantized GEMM of a given size where two kernels compute the same values at different
speeds: the one place these choices live, as data. Each table is (from this many rows, kernel) pairs in
increasing order; the last entry at or below the row count applies.

The thresholds come from `benchmarks/gpu_expert_gemm.py`, which times every candidate per size and prints the
table its measurements give (`recommended_tables` in its JSON). A table not measured yet keeps the kernel that
ran before the alternatives existed at every size (the expert table: the W4A16 kernel), so an unmeasured route
never slows a model down; tests force each route (tests/test_gpu_quant.py, tests/test_gpu_published.py,
tests/test_dequant_gemm.py).
"""

from __future__ import annotations

# MXFP4 routed experts with FP8-rounded activations (LayerOps.grouped_gemm_a8), by routed rows per expert (tokens x
# top-k / experts: what amortizes a dequantized expert): "w4a16" = round the rows, then the weight-only W4A16
# kernel; "w4a8" = the FP8 tensor-core kernel; "bf16_dequant" = round the rows, dequantize the experts to bf16
# (bounded chunks), then torch._grouped_mm (dequant_gemm.py). H200 (gpu_expert_gemm.py, 2026-12-03), TFLOP/s of
# bf16_dequant / w4a16: V4-Flash 96 rows per expert 111-114 / 143-146, 192: 196-210 / 143-149, 384: 289-291 /
# 167-172; V4.1-Flash 128: 133-135 / 138-141 (even), 256: 218-234 / 163-170
EXPERT_KERNEL_BY_ROWS_PER_EXPERT: tuple[tuple[int, str], ...] = ((0, "w4a16"), (192, "bf16_dequant"))
# The same for experts the folded W4A8 kernel takes (1 x 128 activation groups, as V4's; scales that fold exactly:
# `triton_w4a8.fold_exact`). H200 (gpu_expert_gemm.py --sweep, 2026-12-03), V4-Flash, us per GEMM at its tuned
# tiles (gate_up / down) against W4A16 and bf16_dequant: 1 token 36.9 / 19.9 vs 56 / 27; 32 tokens 508 / 269 vs
# 780 / 353; 1K 1,343 / 641 vs 2,497 / 1,147; 8K (192 rows per expert) 5,201 / 2,504 (317-329 TFLOP/s) vs the
# dequant route's 7,400 / 3,900 (210-222 TFLOP/s)
FOLDED_EXPERT_KERNEL_BY_ROWS_PER_EXPERT: tuple[tuple[int, str], ...] = ((0, "w4a8"),)
# FP8 linears with blocks under 128 (V4.1's 32 x 32; cuBLAS' blockwise scaling takes only 128), by tokens: "fp8" =
# the W8A8 Triton kernel (a rescale per block of K); "bf16" = weight tiles dequantized to bf16 inside a bf16 GEMM,
# on activations rounded as W8A8 rounds them; "bf16_dequant" = the same rounded activations, the weight dequantized
# to a bf16 buffer, then cuBLAS (dequant_gemm.py). H200, V4.1 shapes: 255-263 TFLOP/s for "fp8" against 646-668
# for "bf16_dequant" (dequant included) from 256 tokens on
FP8_FINE_BLOCK_BY_M: tuple[tuple[int, str], ...] = ((0, "fp8"), (256, "bf16_dequant"))
# V4's grouped output projection `wo_a` (block-diagonal FP8, weight-only), by tokens (rows per group): "w8a16" = the
# grouped Triton kernel, each group an "expert" (LayerOps.grouped_gemm); "bf16_dequant" = the weight dequantized to
# a bf16 buffer, then one cuBLAS batched GEMM over the groups (dequant_gemm.grouped_linear_dequant). H200,
# V4-Flash width (8 groups of 1,024 x 4,096; gpu_expert_gemm.py --only wo_a, 2026-12-03), us w8a16 / bf16_dequant:
# 32 tokens 42.9 / 52.5, 64: 68.4 / 53.7, 128: 141 / 55.7, 2K: 647 / 214, 8K: 2,475 / 809 (the batched GEMM alone:
# 794)
FP8_GROUPED_BY_TOKENS: tuple[tuple[int, str], ...] = ((0, "w8a16"), (64, "bf16_dequant"))


def choose(table: tuple[tuple[int, str], ...], m: int) -> str:
    """The kernel `table` names for `m` rows."""
    kernel = table[0][1]
    for start, name in table:
        if m >= start:
            kernel = name
    return kernel


def expert_kernel(rows: int, experts: int, folded: bool = False) -> str:
    """The route for `rows` routed rows over `experts` stacked experts (by whole rows per expert); `folded`: the
    experts can take the folded W4A8 kernel."""
    table = FOLDED_EXPERT_KERNEL_BY_ROWS_PER_EXPERT if folded else EXPERT_KERNEL_BY_ROWS_PER_EXPERT
    return choose(table, rows // max(1, experts))


def fp8_fine_block_kernel(m: int) -> str:
    return choose(FP8_FINE_BLOCK_BY_M, m)


def fp8_grouped_kernel(tokens: int) -> str:
    return choose(FP8_GROUPED_BY_TOKENS, tokens)
