"""Triton kernels, one per file, each with its launcher: lse_forward, indexed_dot, backward."""
