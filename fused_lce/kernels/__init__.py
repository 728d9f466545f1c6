"""Triton kernels, one per file (or a close pair), each with its launcher: lse_forward (the
forward log-sum-exp and target logit), gemm_backward (the default GEMM backward's logit-gradient
chunks, the kernel that forms them from kept logits, and the GEMM backward's host driver, which
follows the plan that fused_lce.backward_plan makes), tiles_backward (the fused tiles backward
with filtering), logit_rows (row statistics and the gradient over a stored logits chunk),
exp_logits (the bf16 walk's logits GEMM that stores exponentials, and its row kernels), and
common (what they share: the logit tile, its bias + soft-cap epilogue, the logit gradient's
formula, launcher checks). products, scale and softmax_merge are the torch pieces beside them."""
