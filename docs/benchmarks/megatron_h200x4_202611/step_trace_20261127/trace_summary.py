"""Where one traced training step's time goes (a Chrome trace from the launcher's --profile-step).

python trace_summary.py TRACE.json[.gz] [...]: per trace, the step's span, the GPU's busy time, the
host's waits on the device, the host time of gloo collectives, the host time inside the loss's
autograd Function (forward and backward), and the longest GPU idle gaps with the host op that ran
at the time.
"""

import gzip
import json
import sys
from pathlib import Path

# The launcher's own interval union (scripts/lce_train/step_profile.py), from the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts"))
from lce_train.step_profile import union_ms  # noqa: E402

SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
        "aten::_local_scalar_dense")


def summarise(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if "dur" in e and e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function",
                                                  "user_annotation", "cuda_driver")]
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    print(f"== {path}")
    busy = union_ms([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    print(f"span {(t1 - t0) / 1e3:.2f} ms; GPU busy {busy:.2f} ms ({len(kernels)} kernels/copies)")
    # NCCL kernels spin while a peer is late: their time is mostly waiting.
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    print(f"compute kernels {union_ms(compute):.2f} ms, NCCL kernels {union_ms(nccl):.2f} ms")
    for label, pick in [
        ("host waits on the device", lambda n: n in SYNC),
        ("gloo", lambda n: "gloo" in n.lower()),
        ("nccl (host enqueue)", lambda n: "nccl" in n.lower() and not n.startswith("nccl:")),
        ("LCEFunction forward (host)", lambda n: n == "LCEFunction"),
        ("LCEFunction backward (host)", lambda n: "LCEFunctionBackward" in n),
        ("megatron fused CE forward (host)",
         lambda n: "_VocabParallelCrossEntropy" in n and "Backward" not in n),
        ("megatron fused CE backward (host)",
         lambda n: "_VocabParallelCrossEntropy" in n and "Backward" in n),
        ("optimizer step (host)", lambda n: "Optimizer.step" in n or n.endswith("optimizer.step")),
    ]:
        sel = [e for e in host if pick(e["name"])]
        if sel:
            names = sorted({e["name"] for e in sel})[:4]
            print(f"{label:36s} {union_ms([(e['ts'], e['ts'] + e['dur']) for e in sel]):8.2f} ms "
                  f"in {len(sel)} events  {names}")
    # GPU idle gaps, with the longest host op under way during each
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    if not spans:
        return
    gaps, hi = [], spans[0][1]
    for a, b in spans[1:]:
        if a > hi:
            gaps.append((a - hi, hi, a))
        hi = max(hi, b)
    gaps.sort(reverse=True)
    idle = sum(g[0] for g in gaps) / 1e3
    print(f"GPU idle inside the span: {idle:.2f} ms in {len(gaps)} gaps; longest:")
    cpu_ops = [e for e in host if e.get("cat") in ("cpu_op", "python_function", "cuda_runtime")]
    for gap, lo, hi in gaps[:12]:
        under = [e for e in cpu_ops if e["ts"] <= lo + 1 and e["ts"] + e["dur"] >= hi - 1]
        under.sort(key=lambda e: e["dur"])
        names = " < ".join(e["name"][:60] for e in under[:3])
        print(f"  {gap / 1e3:6.2f} ms at +{(lo - t0) / 1e3:7.2f}: {names}")


for p in sys.argv[1:]:
    summarise(p)
