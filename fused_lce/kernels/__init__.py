"""Triton kernels, one per file (or a close pair), each with its launcher: lse_forward (the
forward log-sum-exp and target logit), gemm_backward (the recomputing GEMM backward's
logit-gradient chunks, the kernel that forms them from kept logits, and the GEMM backward's host
driver, which follows the plan that fused_lce.backward_plan makes), tiles_backward (the fused
tiles backward with filtering), logit_rows (row statistics and the gradient over a stored logits
chunk), exp_logits (the bf16 walk's logits GEMM that stores exponentials, and its row kernels),
exp_logits_grad (the chunk's gradients from those exponentials), scale (an in-place scale by a
device scalar) and common (what they share: the logit tile, its bias + soft-cap epilogue, the
logit gradient's formula, launcher checks). The pure-torch pieces the launchers share with the
chunked path are the op's: fused_lce.fp32_products and fused_lce.softmax_merge."""
