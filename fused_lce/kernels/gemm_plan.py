"""Host-side planners of the GEMM backward (kernels/grad_logits.py's ``lce_backward_gemm``):
how many rows and columns a G chunk takes under the scratch budget, and where the buffers go when
they borrow the weight gradient's storage. Pure arithmetic on sizes; no kernel, no tensor."""

from __future__ import annotations

from dataclasses import dataclass

# Measured on an H100 (docs/benchmarks/single_gpu_h100_202611/run3): 16384 columns rather than
# 4096 take 1.1 ms (Gemma-2 2B) and 1.7 ms (Llama-3 8B) off a step of 8192 tokens, mostly in the
# fp32 dE accumulation, which re-reads its (N, D) accumulator once per chunk.
MAX_CHUNK_COLS = 16384


def plan_gemm_chunks(
    n_rows: int, n_vocab: int, d_model: int, elem_bytes: int, scratch_bytes: int, min_tiles: int
) -> tuple[int, int]:
    """(rows, cols) per chunk so that the chunk's buffers fit ``scratch_bytes``.

    A token chunk holds an fp32 dE accumulator and the gathered hidden rows (``d_model * (4 +
    elem_bytes)`` bytes a row); the G buffer takes ``rows * cols * elem_bytes``. One chunk of
    every row is preferred: the weight gradient is then one GEMM per vocabulary chunk,
    accumulated in fp32 from start to end. Under a tight budget the rows shrink until a G chunk
    still has ``min_tiles`` tiles of 128 x 256 (a full wave of the GPU) and at least 1024 columns.
    A chunk of every row stops at ``MAX_CHUNK_COLS`` columns, so small problems leave budget unused.
    """
    per_row = d_model * (4 + elem_bytes)

    def cols_for(rows: int) -> int:
        left = scratch_bytes - rows * per_row
        return (left // (rows * elem_bytes)) // 256 * 256 if left > 0 else 0

    rows = n_rows
    if cols_for(rows) < min(1024, n_vocab):
        rows = max(128, n_rows // 128 * 128)
        while rows > 128 and (
            cols_for(rows) < 1024 or (rows // 128) * (cols_for(rows) // 256) < min_tiles
        ):
            rows -= 128
    cols = max(256, cols_for(rows))
    if rows >= n_rows:
        # Every row fits: past MAX_CHUNK_COLS columns the GEMMs gain nothing, so do not take
        # memory for them. (Under a tight budget wide chunks are what keeps the GPU full.)
        cols = min(cols, MAX_CHUNK_COLS)
    return max(min(rows, n_rows), 1), min(cols, max(n_vocab, 1))


# Columns per G chunk while G lives in the weight gradient's storage: wide enough for the fp32
# dE accumulation to stay compute-bound, narrow enough that few columns need a second pass.
BORROWED_CHUNK_COLS = 4096
# The last pass halves its G chunk until this width, then takes the small buffer of the budget.
MIN_BORROWED_COLS = 256
# The borrowed layout costs a second logit pass over the share ``free_from / V`` of the
# vocabulary. Token chunks cost nothing extra while they are tall (N = 8192 tokens in one chunk
# run at 1.12x the four-GEMM bound on an H100), so past MAX_SECOND_PASS they win; short ones
# lose more (the lean budget's 256-row chunks took 2.4x the default at N = 65536).
MAX_SECOND_PASS = 0.5
MIN_TOKEN_CHUNK_ROWS = 8192


@dataclass(frozen=True)
class WeightBufferLayout:
    """Where the backward keeps its buffers inside the (V, D) weight gradient, in weight rows.

    Rows [0, g_rows) hold the G chunk (N x chunk_cols, weight dtype); rows [g_rows, free_from)
    hold the fp32 dE accumulator (N x D). Columns at or past ``free_from`` get their weight
    gradient on the first pass; the others are recomputed once dE is done (the docstring of
    ``_backward_in_weight_buffer``), the last of them through a small G buffer of ``small_cols``
    columns taken from the budget.
    """

    chunk_cols: int
    g_rows: int
    free_from: int
    small_cols: int


def _rows_holding(n_bytes: int, row_bytes: int) -> int:
    """Weight rows that hold ``n_bytes``; a multiple of 8, so what follows is 16-byte aligned."""
    rows = -(-n_bytes // row_bytes)
    return -(-rows // 8) * 8


def plan_weight_buffer(
    n_rows: int, n_vocab: int, d_model: int, elem_bytes: int, scratch_bytes: int
) -> WeightBufferLayout | None:
    """The layout, or None where the buffers do not fit: the G chunk and the fp32 accumulator
    need more rows than the weight gradient has (at 16 bits, 2N + N * chunk_cols / D rows), or
    the budget cannot hold a G chunk of 16 columns."""
    if d_model == 0:
        return None  # a weight gradient without storage lends none
    row_bytes = d_model * elem_bytes
    cols = min(BORROWED_CHUNK_COLS, max(MIN_BORROWED_COLS, n_vocab // 8 // 256 * 256))
    g_rows = _rows_holding(n_rows * cols * elem_bytes, row_bytes)
    free_from = g_rows + -(-n_rows * d_model * 4 // row_bytes)
    small_cols = (scratch_bytes - n_rows * 8) // (n_rows * elem_bytes) // 16 * 16
    if free_from > n_vocab or small_cols < 16:
        return None
    return WeightBufferLayout(cols, g_rows, free_from, small_cols)
