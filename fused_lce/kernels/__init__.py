"""Triton kernels, one per file, each with its launcher: lse_forward, backward, grad_logits."""
