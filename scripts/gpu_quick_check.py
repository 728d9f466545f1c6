"""Quick GPU check: cce vs a float64 CPU reference on a few option sets; prints one line each.

    python scripts/gpu_quick_check.py

The full GPU suite is tests/op/test_cce_at_scale.py; this script is the smoke test to run first
on a new machine (seconds).
"""

import torch

from fused_lce import linear_cross_entropy
from fused_lce.options import LCEOptions
from fused_lce.reference import reference_linear_cross_entropy


def rel(a, b):
    return ((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    torch.manual_seed(0)
    n, v = 1000, 5003
    cases = [
        {},
        {"reduction": "sum", "label_smoothing": 0.1},
        {"softcap": 5.0, "z_loss": 1e-3},
        {"filter_eps": None},
        {"filter_eps": "paper"},
        {"deterministic": True},
        {"reduction": "none", "scratch_mb": 0.5},
    ]
    # D = 256 gives 16-byte aligned 16-bit rows, which the kernels read by TMA on Hopper;
    # D = 257 takes the pointer kernels.
    for dtype, d in ((torch.bfloat16, 256), (torch.bfloat16, 257), (torch.float32, 257)):
        h = torch.randn(n, d) * 0.5
        w = torch.randn(v, d) * 0.3
        b = torch.randn(v) * 0.1
        t = torch.randint(0, v, (n,))
        t[::9] = -100
        for kw in cases:
            hg = h.to("cuda", dtype).requires_grad_()
            wg = w.to("cuda", dtype).requires_grad_()
            bg = b.to("cuda", dtype).requires_grad_()
            loss = linear_cross_entropy(hg, wg, t.cuda(), bg, impl="cce", **kw)
            loss.sum().backward()
            ref_opts = {k: kw[k] for k in ("reduction", "label_smoothing", "softcap", "z_loss")
                        if k in kw}
            hr = hg.detach().cpu().double().requires_grad_()
            wr = wg.detach().cpu().double().requires_grad_()
            br = bg.detach().cpu().double().requires_grad_()
            ref, _ = reference_linear_cross_entropy(hr, wr, t, br, LCEOptions(**ref_opts))
            ref.sum().backward()
            print(f"{str(dtype):>15} D={d} {str(kw):<45} loss {rel(loss, ref):.1e} "
                  f"dh {rel(hg.grad, hr.grad):.1e} dw {rel(wg.grad, wr.grad):.1e} "
                  f"db {rel(bg.grad, br.grad):.1e}", flush=True)


if __name__ == "__main__":
    main()
