"""Checks of device values that never make the host wait for the GPU.

Two checks look at values only the device holds: the target range (``check_targets``) and, in the
gradient-in-forward backward, whether the per-token upstream gradient is the one the forward
assumed (``upstream_mismatch="nan"``). Reading such a verdict on the host would drain the GPU's
queue every call and cannot be captured in a CUDA graph. So a check ends on the device:

- the faulted call's loss and every gradient it returns are NaN (nothing is silently wrong);
- the device's *fault register* (a few int64, one per device, allocated once) counts the fault
  and keeps the offending call's smallest and largest target for the message;
- the register is copied, asynchronously, to pinned host memory after each check. In a CUDA
  graph the copy is a node of the graph, so replays publish their faults too.

The host reads only that copy: plain memory, never a wait. ``raise_found`` runs at the start and
end of every op call; it raises once for each fault the copy shows that it has not raised yet.
On the CPU the copy is the register itself, so a bad target raises in the call that held it; on
a GPU, a call the host queues after the GPU has run the faulted one, at the latest the first
call after the caller synchronised (an ``.item()`` of the loss, an optimizer step).
``raise_deferred_errors`` waits for the GPU first, for callers that want an answer now. Across
tensor-parallel ranks a verdict is combined on the device before it is counted, so every rank
holds the same register and raises the same error.
"""

from __future__ import annotations

import torch

# The register's words.
BAD_TARGET_CALLS = 0  # calls whose targets held a class outside the vocabulary
MISMATCH_CALLS = 1  # backwards whose upstream gradient was not the assumed one
LOWEST = 2  # the last such call's smallest and largest non-ignored target
HIGHEST = 3
WORDS = 4


class DeviceFaults:
    """One device's register, its host copy, and how many faults of each kind were raised."""

    def __init__(self, device: torch.device):
        self.device = device
        self.register = torch.zeros(WORDS, dtype=torch.int64, device=device)
        if device.type == "cuda":
            # Registered rather than allocated by torch's pinned allocator: that one records an
            # event per copy, which a CUDA graph capture refuses to have queried later.
            self.host = torch.zeros(WORDS, dtype=torch.int64)
            status = torch.cuda.cudart().cudaHostRegister(
                self.host.data_ptr(), self.host.numel() * self.host.element_size(), 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister of the fault register failed: {status}")
        else:
            self.host = self.register
        self.raised = [0, 0]  # BAD_TARGET_CALLS, MISMATCH_CALLS already raised
        self.signs = torch.arange(2, device=device) * 2 - 1  # (-1, 1): min as a max
        # (num_classes, ignore_index, caller) of the last call that checked its targets.
        self.last_check = (0, 0, "")

    def publish(self) -> None:
        """Queue the register's copy to the host (no wait; on the CPU it is the register)."""
        if self.host is not self.register:
            self.host.copy_(self.register, non_blocking=True)


_DEVICES: dict[torch.device, DeviceFaults] = {}


def _key(device: torch.device) -> torch.device:
    """``device`` with its index, as the registers are keyed."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_faults(device: torch.device) -> DeviceFaults:
    """The register of ``device``, made at its first use (make it outside a CUDA graph capture:
    an op call before the capture does, as a warm-up must)."""
    device = _key(device)
    faults = _DEVICES.get(device)
    if faults is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Made in a capture, its zeroing would be a node of the graph: every replay would
            # forget the faults counted before it.
            raise RuntimeError(
                f"fused_lce's first call on {device} is inside a CUDA graph capture: make one "
                "call before capturing (a warm-up step, which also compiles its kernels)")
        faults = _DEVICES[device] = DeviceFaults(device)
    return faults


def target_extremes(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(2,) int64 on the device: minus the smallest and the largest target other than
    ``ignore_index`` (0 for none), so that one all-reduce MAX combines the ranks'."""
    faults = device_faults(target.device)
    if target.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=target.device)
    target = target.reshape(-1)
    kept = torch.where(target == ignore_index, 0, target)
    return torch.stack(torch.aminmax(kept)).long().mul_(faults.signs)


def record_bad_targets(extremes: torch.Tensor, n_classes: int, ignore_index: int,
                       caller: str) -> torch.Tensor:
    """Count a call whose (combined) ``target_extremes`` leave [0, n_classes) in its device's
    register and publish it; returns the call's verdict, a (1,) bool tensor (true: poison)."""
    faults = device_faults(extremes.device)
    faults.last_check = (n_classes, ignore_index, caller)
    found = (extremes[:1] > 0) | (extremes[1:] >= n_classes)
    register = faults.register
    register[BAD_TARGET_CALLS:BAD_TARGET_CALLS + 1].add_(found.long())
    register[LOWEST:] = torch.where(found, extremes * faults.signs, register[LOWEST:])
    faults.publish()
    return found


def record_mismatch(mismatch: torch.Tensor) -> None:
    """Count a backward's combined upstream verdict ((1,), nonzero: the gradients were NaN)."""
    faults = device_faults(mismatch.device)
    faults.register[MISMATCH_CALLS:MISMATCH_CALLS + 1].add_((mismatch.reshape(1) > 0).long())
    faults.publish()


def raise_found(device: torch.device | None = None) -> None:
    """Raise for a fault that the host copy of ``device``'s register (or of every register)
    shows and that was not raised yet; reads host memory only, and makes no register."""
    registers = _DEVICES.values() if device is None else [_DEVICES.get(_key(device))]
    for faults in list(registers):
        if faults is not None:
            _raise_new(faults)


def raise_deferred_errors() -> None:
    """Wait for every device with a fault register, then raise any fault an earlier call found.
    The one check that waits: call it where the program synchronises anyway (after a step, at
    the end of a run), or in tests."""
    for faults in list(_DEVICES.values()):
        if faults.device.type == "cuda":
            torch.cuda.synchronize(faults.device)
        _raise_new(faults)


def _raise_new(faults: DeviceFaults) -> None:
    words = faults.host.tolist()
    targets, mismatches = words[BAD_TARGET_CALLS], words[MISMATCH_CALLS]
    new_targets = targets > faults.raised[0]
    new_mismatches = mismatches > faults.raised[1]
    if not (new_targets or new_mismatches):
        return
    faults.raised = [targets, mismatches]
    if new_targets:
        raise ValueError(bad_target_message(words, faults.last_check))
    raise RuntimeError(MISMATCH_MESSAGE)


def bad_target_message(words: list[int], last_check: tuple[int, int, str]) -> str:
    n_classes, ignore_index, caller = last_check
    lowest, highest = words[LOWEST], words[HIGHEST]
    offending = lowest if lowest < 0 else highest
    return (
        f"{caller}: target holds class {offending}, outside [0, {n_classes}) and not "
        f"ignore_index ({ignore_index}); that call's loss and gradients are NaN (its targets "
        "are checked on the device and the verdict read once it reached the host: on a GPU, "
        "by a later call)"
    )


MISMATCH_MESSAGE = (
    "an earlier backward of this op received per-token loss gradients that are not c * "
    "loss_mask (the mask the forward computed the gradients for), and with "
    "upstream_mismatch='nan' it returned NaN gradients rather than recomputing them: pass the "
    "mask your loss multiplies the losses by as loss_mask, or upstream_mismatch='recompute' "
    "(exact for any upstream gradient, at one host sync a backward; Megatron adapter: "
    "--cce-upstream-mismatch recompute)"
)
