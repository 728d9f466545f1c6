"""``--cuda-graph-impl full_iteration``: the launcher's step as one CUDA graph, as Megatron-LM's.

megatron-core's FullCudaGraphWrapper runs ``forward_backward_func`` eagerly for the warm-up steps,
then captures every micro-batch's forward and backward, the loss and the gradient reduction as
one graph and replays it, copying each step's batches into static buffers first. The optimizer
step stays eager, as in Megatron-LM's ``pretrain_gpt.py``.
"""

from __future__ import annotations

import contextlib
import gc

import torch


def graphed(forward_backward, warmup_steps: int):
    """``forward_backward`` wrapped for full-iteration graphs, from a clean slate."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    release()
    return FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=warmup_steps)


def release() -> None:
    """Drop the graph, its results and its static batches.

    The wrapper and its loader keep them on the class: a second run in one process
    (lce_train.compare_losses) would replay the first run's graph on the first run's buffers,
    and a graph that outlives training keeps NCCL's communicators busy, so that
    ``destroy_process_group`` never returns (seen at TP2 on two H200s, megatron-core 0.19.2).
    """
    from megatron.core import full_cuda_graph

    wrapper = full_cuda_graph.FullCudaGraphWrapper
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wrapper.cuda_graph = {"training": None, "validation": None}
    wrapper.result = {"training": None, "validation": None}
    wrapper.curr_iteration = {"training": 0, "validation": 0}
    full_cuda_graph.StaticBufferLoader.static_buffers = {"training": [], "validation": []}
    gc.collect()


def captured() -> bool:
    """Whether the training graph exists."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    return FullCudaGraphWrapper.cuda_graph["training"] is not None


def state(captured_before: bool) -> str:
    """What the step that just ran did: "eager", "captured" or "replayed"."""
    if captured_before:
        return "replayed"
    return "captured" if captured() else "eager"


def ddp_stream(enabled: bool):
    """Where to build DistributedDataParallel: megatron-core 0.19+ captures on one shared stream,
    and the gradient-accumulation nodes DDP creates must belong to it, or the backward under
    capture waits on a stream that is not capturing (Megatron-LM builds DDP there too)."""
    if not enabled:
        return contextlib.nullcontext()
    from megatron.core import full_cuda_graph

    shared = getattr(full_cuda_graph, "get_shared_capture_stream", None)
    if shared is None:  # 0.16-0.18 capture on a fresh stream each time
        return contextlib.nullcontext()
    stream = shared()
    stream.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(stream)
