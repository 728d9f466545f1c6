"""Vocab-parallel cut cross-entropy across tensor-parallel ranks (installed as fused_lce.parallel).

    from fused_lce.parallel import vocab_parallel_linear_cross_entropy

Everything that talks to other ranks lives in this package: the layer (vocab_parallel.py), its
collectives (comm.py), the ranks' agreement on each call before them (agreement.py) and the
megatron-core adapter (megatron.py, imported lazily).
"""

from .vocab_parallel import vocab_parallel_linear_cross_entropy

__all__ = ["vocab_parallel_linear_cross_entropy"]
