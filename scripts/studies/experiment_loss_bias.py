"""Where the bf16 walk's loss error on trained-like data comes from: per-token lse and target
logit of each path against float64, mean (bias) and RMS. One GPU.

    python scripts/studies/experiment_loss_bias.py [--model phi3_5_mini --tokens 8192]

Paths: the exponentials GEMM's statistics and target_logits (kernels/exp_logits.py); cuBLAS
logits in fp32 (bf16 operands, the tensor cores' fp32 accumulation, no rounding of the output);
cuBLAS logits rounded to bf16 (what torch.compile and the two-pass walk read).
"""

from __future__ import annotations

import argparse
import math

import torch

from fused_lce.kernels.exp_logits import exp_logits, target_logits
from lce_train.bench_lce_inputs import Case, make_inputs
from lce_train.configs import load_model_config


def summary(name: str, value: torch.Tensor, reference: torch.Tensor) -> None:
    error = value.double() - reference
    print(f"{name:>34}: mean {error.mean().item():+.3e}  rms "
          f"{error.pow(2).mean().sqrt().item():.3e}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="phi3_5_mini")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--regime", default="trained")
    args = parser.parse_args(argv)
    cfg = load_model_config(args.model)
    case = Case(args.model, args.tokens, cfg.vocab_size, cfg.hidden_size, args.regime)
    hidden, weight, target = make_inputs(case, torch.bfloat16, "cuda")
    rows = 2048
    print(f"# {torch.cuda.get_device_name()} {args.model} N={args.tokens} {args.regime}; "
          f"errors against float64 per token, nats")
    got = {key: [] for key in ("ours lse", "ours target", "ours nll", "fp32 lse", "fp32 target",
                               "bf16 lse", "bf16 target", "ref lse", "ref target")}
    for start in range(0, args.tokens, rows):
        h, t = hidden[start:start + rows], target[start:start + rows]
        ref = h.double() @ weight.double().t()
        got["ref lse"].append(torch.logsumexp(ref, 1))
        got["ref target"].append(ref.gather(1, t[:, None]).squeeze(1))
        fp32 = torch.mm(h, weight.t(), out_dtype=torch.float32).double()
        got["fp32 lse"].append(torch.logsumexp(fp32, 1))
        got["fp32 target"].append(fp32.gather(1, t[:, None]).squeeze(1))
        bf16 = (h @ weight.t()).double()
        got["bf16 lse"].append(torch.logsumexp(bf16, 1))
        got["bf16 target"].append(bf16.gather(1, t[:, None]).squeeze(1))
        c, columns = target_logits(h, weight, None, t, vocab_start=0, ignore_index=-100,
                                   softcap=None, round_16bit=False)
        shift, sum_exp, z_y = exp_logits(h, weight, None, columns, c, None, softcap=None,
                                         round_16bit=False)
        got["ours lse"].append(shift.double() + torch.log(sum_exp.double()))
        got["ours target"].append(c.double())
        got["ours nll"].append((shift - z_y).double() + torch.log(sum_exp.double()))
    got = {key: torch.cat(value) for key, value in got.items()}
    ref_nll = got["ref lse"] - got["ref target"]
    for path in ("ours", "fp32", "bf16"):
        summary(f"{path} lse", got[f"{path} lse"], got["ref lse"])
        summary(f"{path} target logit", got[f"{path} target"], got["ref target"])
        nll = (got["ours nll"] if path == "ours"
               else got[f"{path} lse"] - got[f"{path} target"])
        summary(f"{path} nll", nll, ref_nll)
        print(f"{'':>34}  mean-loss relative error "
              f"{abs((nll.mean() - ref_nll.mean()) / ref_nll.mean()).item():.2e}")
    assert math.isfinite(ref_nll.mean().item())


if __name__ == "__main__":
    main()
