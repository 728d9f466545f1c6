"""Vocab-parallel cut cross-entropy across tensor-parallel ranks (fused_lce.parallel)."""
