"""The online softmax's merge rule in torch, for every path that combines partial statistics: the
vocabulary splits of the forward kernel, the chunked path's vocabulary chunks and the ranks of the
vocab-parallel layer. The kernels' ``fold_tile`` (kernels/common.py) is its Triton twin.

The rule: a row that has seen no finite logit, as where a -inf bias masks a whole tile, chunk,
split or shard, is shifted by 0 rather than by its max of -inf, so its sum of exponentials is
exp(-inf) = 0 instead of exp(-inf - -inf) = NaN. Pure torch (no Triton), so the chunked path
imports it anywhere.
"""

from __future__ import annotations

import torch


def softmax_shift(row_max: torch.Tensor) -> torch.Tensor:
    """What to subtract before exp: the row's max, or 0 where the row has no finite logit.

    The module docstring says why.
    """
    return torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)


def merge_partials(
    part_max: torch.Tensor, part_sum_exp: torch.Tensor, dim: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, sum of exp(z - max)) over ``dim`` from partial maxima and their own shifted sums.

    Partials with no finite logit (max -inf, sum 0) add nothing; a row with no finite logit in
    any partial keeps max -inf and sum 0, so its lse is -inf, as torch's logsumexp gives.
    """
    row_max = part_max.amax(dim=dim)
    shift = softmax_shift(row_max).unsqueeze(dim)
    sum_exp = (part_sum_exp * torch.exp(part_max - shift)).sum(dim=dim)
    return row_max, sum_exp
