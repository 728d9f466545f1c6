"""Triton kernels, one per file (or a close pair), each with its launcher: lse_forward (the
forward log-sum-exp and target logit), grad_logits (the default GEMM backward's logit-gradient
chunks, the kernel that forms them from kept logits, and the GEMM backward's host driver, which
follows the plan that fused_lce.backward_plan makes), backward (the fused tiles backward with
filtering), and common (what they share)."""
