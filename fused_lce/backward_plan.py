"""Host-side planning of the cce backward that recomputes the logits (where the gradients were not
computed in the forward): which one runs, and how the GEMM one spends its budget.

The options pick that backward (``recomputing_backward``: "gemm" or "tiles"), whether the forward
keeps its logits for it, and how the tiles backward filters and orders the vocabulary. For one
call of the GEMM backward (kernels/gemm_backward.py's ``lce_backward_gemm``)
``plan_gemm_backward`` then names its strategy:

- "kept": G is formed in the forward's kept logits, no logit is recomputed;
- "borrowed": the buffers live in the weight gradient's own storage (a ``WeightBufferLayout``);
- "token_chunks": G chunks of (chunk_rows, chunk_cols) in buffers taken from the budget.

The planners are arithmetic on sizes; the kernels' host driver only dispatches on the plan. The
kernels cannot import this module (docs/architecture.md), so the plan is made here and passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .kernels.common import num_sms
from .kernels.tiles_backward import FILTER_ENTRY, FILTER_MASS, FILTER_OFF, backward_config
from .options import LCEOptions

# ---------------------------------------------------------------------------------------------
# Which backward: the options' policy
# ---------------------------------------------------------------------------------------------

_FILTER_CODES = {"off": FILTER_OFF, "entry": FILTER_ENTRY, "mass": FILTER_MASS}


def recomputing_backward(opts: LCEOptions) -> Literal["gemm", "tiles"]:
    """The backward that recomputes the logits: "tiles" where asked, else "gemm". The default
    ("auto") and "in_forward" compute the gradients in the forward and take this backward only
    where that walk does not apply (``token_walk.plan_forward_gradients`` gives no plan, or
    the upstream gradient is not the assumed one): "gemm" is not what a default call runs."""
    return "tiles" if opts.backward == "tiles" else "gemm"


def keeps_logits(opts: LCEOptions) -> bool:
    """Whether the forward keeps its logits for the backward (LCEOptions.keep_logits)."""
    return opts.keep_logits and recomputing_backward(opts) == "gemm"


def filter_settings(
    opts: LCEOptions, dtype: torch.dtype, n_classes: int, device: torch.device
) -> tuple[int, float]:
    """(FILTER code, per-tile threshold) for the backward kernel.

    The safe criterion's budget eps is spread evenly over the vocabulary's tiles, so a tile may
    hold at most eps * BLOCK_V / V of a row's mass. Label smoothing gives every column a gradient
    of ls / V, which that criterion must not drop: it then computes every tile.
    """
    mode, eps = opts.filter_mode(dtype)
    if mode == "mass":
        if opts.label_smoothing > 0:
            return FILTER_OFF, 0.0
        block_v = backward_config(device).block_v
        return FILTER_MASS, eps * block_v / n_classes
    return _FILTER_CODES[mode], eps


def use_vocab_sort(opts: LCEOptions, filter_code: int) -> bool:
    return (
        recomputing_backward(opts) == "tiles"
        and opts.vocab_sort
        and filter_code != FILTER_OFF
        and not opts.deterministic
    )


# ---------------------------------------------------------------------------------------------
# Token chunks: G chunks in buffers taken from the budget
# ---------------------------------------------------------------------------------------------

# Measured on an H100 (CHANGELOG.md, 2026-11-22): 16384 columns rather than
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


# ---------------------------------------------------------------------------------------------
# Borrowed: the buffers inside the weight gradient's storage
# ---------------------------------------------------------------------------------------------

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
    ``_backward_in_weight_buffer``). The G chunk's own columns come last: ``halved_chunks`` lists
    (first row, width) of each halved G chunk, which serves the rows from its first row up to
    the previous one's (``g_rows`` for the first); the rows below the last go through a small G
    buffer of ``small_cols`` columns taken from the budget.
    """

    chunk_cols: int
    g_rows: int
    free_from: int
    small_cols: int
    halved_chunks: tuple[tuple[int, int], ...] = ()


def _rows_holding(n_bytes: int, row_bytes: int) -> int:
    """Weight rows that hold ``n_bytes``; a multiple of 8, so what follows is 16-byte aligned."""
    rows = -(-n_bytes // row_bytes)
    return -(-rows // 8) * 8


def _halved_chunks(
    n_rows: int, d_model: int, elem_bytes: int, g_rows: int, chunk_cols: int, small_cols: int
) -> tuple[tuple[int, int], ...]:
    """Each round halves the G chunk, which then fits below the columns it serves, while the
    half is still wider than the small buffer and at least MIN_BORROWED_COLS."""
    chunks = []
    top, width = g_rows, chunk_cols
    while width // 2 >= MIN_BORROWED_COLS and width // 2 > small_cols:
        width //= 2
        bottom = _rows_holding(n_rows * width * elem_bytes, d_model * elem_bytes)
        if bottom >= top:
            break
        chunks.append((bottom, width))
        top = bottom
    return tuple(chunks)


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
    halved = _halved_chunks(n_rows, d_model, elem_bytes, g_rows, cols, small_cols)
    return WeightBufferLayout(cols, g_rows, free_from, small_cols, halved)


# ---------------------------------------------------------------------------------------------
# The GEMM backward's strategy for one call
# ---------------------------------------------------------------------------------------------

# Beside the chunk buffers live the per-token vectors (lse, coefficients, row order, targets,
# their temporaries: 64 bytes a token) and the fp32 bias gradient; the budget covers them too.
# (Measured at N = 65536 with 32 bytes a token: 1.8 MiB over a 512 MiB budget.)
BYTES_PER_TOKEN = 64


@dataclass(frozen=True)
class GemmBackwardPlan:
    """The strategy of one GEMM backward call.

    ``kind`` is "kept", "borrowed" (with ``layout``), "token_chunks" (with ``chunk_rows`` and
    ``chunk_cols``), or "empty" for a call without rows or columns, which computes nothing.
    """

    kind: Literal["empty", "kept", "borrowed", "token_chunks"]
    layout: WeightBufferLayout | None = None
    chunk_rows: int = 0
    chunk_cols: int = 0


def plan_gemm_backward(
    n_rows: int,
    n_vocab: int,
    d_model: int,
    elem_bytes: int,
    scratch_bytes: int,
    *,
    min_tiles: int,
    bias_grad: bool,
    borrowable: bool,
    kept: bool,
) -> GemmBackwardPlan:
    """The strategy of ``lce_backward_gemm`` for hidden (n_rows, d_model), weight (n_vocab,
    d_model), both of ``elem_bytes`` an element.

    Args:
        scratch_bytes: the budget of the backward's buffers (LCEOptions.scratch_bytes).
        min_tiles: G tiles that fill the GPU (its multiprocessors).
        bias_grad: whether the call computes a bias gradient (fp32, inside the budget).
        borrowable: whether the weight gradient is a fresh contiguous tensor and the call also
            computes d_hidden, so that its storage can hold the buffers.
        kept: whether the forward kept its logits for this call.
    """
    if n_rows == 0 or n_vocab == 0:
        return GemmBackwardPlan("empty")
    if kept:
        return GemmBackwardPlan("kept")
    buffers = scratch_bytes - n_rows * BYTES_PER_TOKEN - (n_vocab * 4 if bias_grad else 0)
    rows, cols = plan_gemm_chunks(n_rows, n_vocab, d_model, elem_bytes, buffers, min_tiles)
    needed = rows * d_model * (4 + elem_bytes) + rows * cols * elem_bytes
    if (rows < n_rows or needed > buffers) and borrowable:
        # The budget cannot hold every row: rather than walk token chunks (and round the weight
        # gradient to 16 bits once per chunk), borrow the weight gradient's own storage.
        layout = plan_weight_buffer(n_rows, n_vocab, d_model, elem_bytes, buffers)
        if layout is not None and (
            layout.free_from <= MAX_SECOND_PASS * n_vocab or rows < MIN_TOKEN_CHUNK_ROWS
        ):
            return GemmBackwardPlan("borrowed", layout=layout)
    return GemmBackwardPlan("token_chunks", chunk_rows=rows, chunk_cols=cols)


def plan_gemm_backward_for(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    scratch_bytes: int,
    want_hidden: bool = True,
    want_weight: bool = True,
    want_bias: bool = True,
    into_accumulator: bool = False,
    kept: bool = False,
) -> GemmBackwardPlan:
    """``plan_gemm_backward`` for the arguments of an ``lce_backward_gemm`` call (same names;
    ``into_accumulator``: a ``d_weight_accumulator`` is given)."""
    n_rows, d_model = hidden.shape
    # lce_backward_gemm allocates d_weight as torch.empty_like(weight), which keeps the strides
    # of a dense weight: a transposed weight gets a gradient not laid out in weight rows.
    fresh_d_weight = want_weight and not into_accumulator
    contiguous = torch.empty_like(weight, device="meta").is_contiguous()
    return plan_gemm_backward(
        n_rows,
        weight.shape[0],
        d_model,
        hidden.element_size(),
        scratch_bytes,
        min_tiles=num_sms(hidden.device),
        bias_grad=want_bias and bias is not None,
        borrowable=fresh_d_weight and contiguous and want_hidden,
        kept=kept,
    )
