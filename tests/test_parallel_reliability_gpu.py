"""test_parallel_reliability.py's suites on NCCL with the real kernels, one process per GPU.

Run on a machine with 2 GPUs: ``python -m pytest -q tests/test_parallel_reliability_gpu.py``.
"""

from __future__ import annotations

import pytest
from helpers_parallel import run_on_ranks
from test_parallel_reliability import _edge_suite, _precision_suite, _strided_suite

pytestmark = pytest.mark.requires_gpus(2)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("suite", [_strided_suite, _precision_suite, _edge_suite],
                         ids=["strided", "confident-tokens", "second-order-uint8-empty"])
def test_reliability_nccl(suite, tmp_path):
    # Generous timeout: the first call of each kernel compiles it.
    run_on_ranks(2, suite, "cuda", out_dir=tmp_path, backend="nccl", timeout_s=600,
                 interpret=False)
