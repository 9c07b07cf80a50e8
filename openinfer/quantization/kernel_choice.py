"""Which kernel runs a quantized GEMM of a given size where two kernels compute the same values at different
speeds: the one place these choices live, as data. Each table is (from this many rows, kernel) pairs in
increasing order; the last entry at or below the row count applies.

The thresholds come from `benchmarks/gpu_expert_gemm.py`, which times every candidate per size and prints the
table its measurements give (`recommended_tables` in its JSON). Measured on: (not yet; the values below are
estimates from the kernels' arithmetic, to be replaced by the H200 run's table): W4A16's in-register bf16
decode costs the same at any M, while W4A8 adds a quantization launch (a few us) and wins once the GEMM is
MMA-bound; the dequantize-to-bf16 FP8 path pays a weight dequantization per call, amortized at large M.
"""

from __future__ import annotations

# MXFP4 routed experts with FP8-rounded activations (LayerOps.grouped_gemm_a8), by routed rows (tokens x top-k):
# "w4a16" = round the rows, then the weight-only W4A16 kernel; "w4a8" = the FP8 tensor-core kernel
EXPERT_KERNEL_BY_ROWS: tuple[tuple[int, str], ...] = ((0, "w4a16"), (1024, "w4a8"))
# FP8 linears with blocks under 128 (V4.1's 32 x 32; cuBLAS' blockwise scaling takes only 128), by tokens: "fp8" =
# the W8A8 Triton kernel (a rescale per block of K); "bf16" = weight tiles dequantized to bf16 inside a bf16 GEMM,
# on activations rounded as W8A8 rounds them
FP8_FINE_BLOCK_BY_M: tuple[tuple[int, str], ...] = ((0, "fp8"), (2048, "bf16"))


def choose(table: tuple[tuple[int, str], ...], m: int) -> str:
    """The kernel `table` names for `m` rows."""
    kernel = table[0][1]
    for start, name in table:
        if m >= start:
            kernel = name
    return kernel


def expert_kernel(rows: int) -> str:
    return choose(EXPERT_KERNEL_BY_ROWS, rows)


def fp8_fine_block_kernel(m: int) -> str:
    return choose(FP8_FINE_BLOCK_BY_M, m)
