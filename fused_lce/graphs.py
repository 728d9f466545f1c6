"""The training forward captured once as a CUDA graph and replayed: the host cost of one launch.

The gradient-in-forward walk queues some 25 kernels and small torch calls a token chunk, and
the Python between them costs the host 3-5 ms a call: more than the GPU work of a small shard,
so the GPU idles (docs/benchmarks/). The work itself depends only on what the call's key names
(shapes, dtypes, options, the weight's address, the process group, the stream), so the
second call with a key captures it into a CUDA graph and every later call replays it:

    static_input.copy_(input); static_target.copy_(target); [static_mask.copy_(loss_mask)]
    graph.replay()  ->  loss, lse, per-token vectors, the stored gradients (in the graph's pool)

The first call with a key runs eagerly: it compiles and autotunes the kernels and makes the
fault register, none of which a capture may do. A call made inside someone else's capture
(Megatron's full-iteration graphs) runs eagerly too, so that capture records the kernels.

What the replay writes lives in the graph's private memory until the next replay, so:

- the loss and lse handed to the caller are copies (two small launches);
- the per-token vectors and stored gradients the backward needs stay in a *slot*, leased from
  the forward until its backward has queued its last read (or its autograd graph is freed);
- the backward scales the stored gradients in place and returns them, as the eager backward
  does (no copy: the (V, D) weight gradient is the largest tensor of the call). Autograd may
  keep one, as a leaf's ``.grad`` or a view of it; a slot whose outputs anyone but the slot
  still references (torch's use counts of each tensor and its memory, read on the host) is
  not replayed.

The backward's own device work (the upstream gradient's scale and its check against the one
the forward assumed, the ranks' verdict combined, the gradients scaled and reduced: some 25
launches) is a graph of the slot as well, keyed by the upstream gradient's layout and captured
at the slot's second backward; its static input is the upstream gradient, its outputs join the
slot's.

A forward that finds no free slot (several micro-batches in flight, a kept gradient) takes
another, up to ``MAX_SLOTS``, each its own capture and memory, and past them runs eagerly.

Every rank of a tensor-parallel group queues the same collectives in the same order whether it
replays or runs eagerly, so ranks need not decide alike. Replays run on the stream they were
captured for (the key holds it), which keeps a backward's reads ahead of the next replay.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

# Calls with a key before it is captured: the first compiles and autotunes.
EAGER_CALLS = 1
# Forwards of one key whose backwards are pending at once (1F1B keeps one at the last stage).
MAX_SLOTS = 2
# Keys kept at once; each captured one holds a chunk buffer and its gradients.
MAX_KEYS = 4
# Backward graphs a slot keeps (one per layout of the upstream gradient).
MAX_BACKWARDS = 2


class Slot:
    """One capture: its graph, what its replay writes, the backward graphs that scale what it
    wrote, and how many references each output tensor and its memory had when nobody but the
    slot held them."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: Any, static: tuple):
        self.graph, self.outputs, self.static, self.leased = graph, outputs, static, False
        self.tensors = list(_tensors(outputs))
        self.alone = [_references(x) for x in self.tensors]
        # Backward graphs by key: (graph, static upstream gradients, outputs).
        self.backwards: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple, Any]] = {}
        self.backward_calls = 0
        self.backward_failed = False

    @property
    def free(self) -> bool:
        """Whether a replay may rewrite the outputs: no backward pending and no gradient the
        backward returned still held (autograd may keep one as a leaf's ``.grad``)."""
        return not self.leased and [_references(x) for x in self.tensors] == self.alone

    def backward(self, key: tuple, given: tuple[torch.Tensor, ...],
                 walk: Callable[..., Any]) -> Any | None:
        """``walk(*static copies of given)``'s outputs, replayed from the key's backward graph
        (captured at the slot's second backward, the first having compiled its kernels), or
        None: run it eagerly."""
        self.backward_calls += 1
        entry = self.backwards.get(key)
        if entry is None:
            if (self.backward_failed or self.backward_calls <= EAGER_CALLS
                    or len(self.backwards) >= MAX_BACKWARDS):
                return None
            static = tuple(torch.zeros_like(x) for x in given)
            _copy_into(static, given)
            try:
                graph, outputs = record(walk, static)
            except Exception as exc:  # noqa: BLE001 - any failure: backwards run eagerly
                self.backward_failed = True
                warnings.warn(f"fused_lce: capturing the training backward failed ({exc!r}); "
                              "it runs without its CUDA graph", stacklevel=4)
                return None
            entry = self.backwards[key] = (graph, static, outputs)
            self._track(outputs)
        else:
            _copy_into(entry[1], given)
        graph, _, outputs = entry
        graph.replay()
        return outputs

    def _track(self, outputs: Any) -> None:
        """Count the backward graph's outputs among the slot's tensors. One that is a view of
        a tensor counted already holds that memory, and the tensor it views, once more for as
        long as the slot keeps it: their counts when nobody else holds them rise by one."""
        counted = len(self.tensors)
        for tensor in _tensors(outputs):
            if any(tensor is known for known in self.tensors):
                continue
            memory = tensor.untyped_storage().data_ptr()
            for i, known in enumerate(self.tensors[:counted]):
                if tensor.numel() and known.untyped_storage().data_ptr() == memory:
                    viewed = int(tensor._base is known)
                    self.alone[i] = (self.alone[i][0] + viewed, self.alone[i][1] + 1)
            self.tensors.append(tensor)
            self.alone.append(_references(tensor))


def _references(tensor: torch.Tensor) -> tuple[int, int]:
    """(references to the tensor, references to its memory), as torch counts them."""
    return tensor._use_count(), torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


class Lease:
    """A slot held from a forward to its backward; released by ``release`` or when dropped."""

    def __init__(self, slot: Slot):
        self.slot = slot
        slot.leased = True

    def release(self) -> None:
        if self.slot is not None:
            self.slot.leased, self.slot = False, None

    def __del__(self):
        self.release()


class CapturedWalk:
    """One key: how many calls it saw and its slots."""

    def __init__(self):
        self.calls = 0
        self.slots: list[Slot] = []
        self.failed = False

    def run(self, inputs: tuple[torch.Tensor | None, ...],
            walk: Callable[..., Any]) -> tuple[Any, Lease] | None:
        """(``walk(*static copies of inputs)``'s outputs, their lease), or None: run it
        eagerly."""
        self.calls += 1
        if self.failed or self.calls <= EAGER_CALLS:
            return None
        slot = next((slot for slot in self.slots if slot.free), None)
        if slot is None:
            if len(self.slots) >= MAX_SLOTS:
                return None
            # Each slot its own static inputs: its backward graph reads the target while
            # another slot's forward replays.
            static = tuple(None if x is None else torch.zeros_like(x) for x in inputs)
            _copy_into(static, inputs)
            slot = self._capture(static, walk)
            if slot is None:
                return None
        else:
            _copy_into(slot.static, inputs)
        slot.graph.replay()
        return slot.outputs, Lease(slot)

    def _capture(self, static, walk) -> Slot | None:
        try:
            graph, outputs = record(walk, static)
        except Exception as exc:  # noqa: BLE001 - any failure: this key runs eagerly from now
            self.failed = True
            warnings.warn(f"fused_lce: capturing the training forward failed ({exc!r}); this "
                          "shape runs without its CUDA graph", stacklevel=4)
            return None
        slot = Slot(graph, outputs, static)
        self.slots.append(slot)
        return slot

    @property
    def leased(self) -> bool:
        return any(slot.leased for slot in self.slots)


def _copy_into(static: tuple, given: tuple) -> None:
    for target, value in zip(static, given):
        if target is not None:
            target.copy_(value)


def record(walk: Callable[..., Any], static: tuple) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(a CUDA graph of ``walk(*static)``, the outputs its replays write), captured on a side
    stream. Nothing runs: the caller, having filled ``static``, replays."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    stream = _capture_stream(current.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            # thread_local: NCCL's watchdog thread may query events meanwhile.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = walk(*static)
            finally:
                graph.capture_end()
    finally:
        current.wait_stream(stream)
    return graph, outputs


_WALKS: OrderedDict[tuple, CapturedWalk] = OrderedDict()
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


def captured_walk(key: tuple) -> CapturedWalk:
    """The key's entry, made at its first call; the least recently used keys beyond
    ``MAX_KEYS`` are dropped (captured ones last, leased ones never)."""
    walk = _WALKS.get(key)
    if walk is not None:
        _WALKS.move_to_end(key)
        return walk
    walk = _WALKS[key] = CapturedWalk()
    while len(_WALKS) > MAX_KEYS:
        idle = [k for k, w in _WALKS.items() if k != key and not w.leased]
        if not idle:
            break
        uncaptured = [k for k in idle if not _WALKS[k].slots]
        del _WALKS[(uncaptured or idle)[0]]
    return walk


def clear() -> None:
    """Drop every captured graph not leased (their memory returns to torch's allocator)."""
    for key in [k for k, w in _WALKS.items() if not w.leased]:
        del _WALKS[key]


def tensor_key(tensor: torch.Tensor | None, address: bool = False) -> tuple | None:
    """What a capture fixes of a tensor: its layout, and with ``address`` where it lives."""
    if tensor is None:
        return None
    layout = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
    return (*layout, tensor.data_ptr()) if address else layout


def applies(device: torch.device, enabled: bool) -> bool:
    """Whether a call on ``device`` may replay: a CUDA call outside any capture."""
    return (enabled and device.type == "cuda"
            and not torch.cuda.is_current_stream_capturing())
