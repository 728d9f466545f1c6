"""Evaluation and probes (docs/training_equivalence.md): the validation loss on held-out
windows, and the loss layer's gradients against an fp32 reference with the unseen-token measures.
"""

from __future__ import annotations

import time
import traceback
from functools import partial

import torch

from lce_train.checkpoint import rng_state, set_rng_state
from lce_train.data import TokenWindows, token_counts
from lce_train.model import loss_func
from lce_train.signatures import supported_kwargs


class SeenTokens:
    """Which token ids training has seen, for the unseen-token measures of the probes.

    With ``--data-path``: the counts of the whole training file (fixed; a token "unseen in
    training" never occurs in the training data). With mock data: the counts of the windows this
    run has drawn so far (tokens and labels), updated from every micro-batch; the run's own
    stream is its corpus. Ids past the tokenizer's vocabulary (Megatron's padding) count as unseen.
    """

    def __init__(self, args, device):
        self.vocab = args.padded_vocab_size
        self.fixed = args.data_path is not None
        if self.fixed:
            self.counts = token_counts(args.data_path, self.vocab).to(device)
        else:
            self.counts = torch.zeros(self.vocab, dtype=torch.int64, device=device)

    def observe(self, batch: dict) -> None:
        if not self.fixed:
            window = torch.cat([batch["tokens"][:, :1], batch["labels"]], dim=1)
            self.counts += torch.bincount(window.flatten(), minlength=self.vocab)

    def unseen(self) -> torch.Tensor:
        """(V,) bool: ids with zero count."""
        return self.counts == 0


class OutputLayerTap:
    """Copies what enters the output layer (hidden states and weight, tied or not) in the first
    forward after :meth:`arm`; the copies outlive the optimizer step that changes the weight.

    A pre-hook on the output layer sees exactly its inputs. Should a megatron-core version call
    the layer without going through its hooks, a hook on the decoder's final norm (whose output
    the output layer receives) stands in, with the model's output weight; it stays armed only
    until the output layer's hook has been seen to work.
    """

    def __init__(self, gpt):
        self.gpt = gpt
        self.captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.armed: set[str] = set()
        self.output_layer_seen = False
        self.handles = [gpt.output_layer.register_forward_pre_hook(self._output_layer_hook,
                                                                   with_kwargs=True)]
        final_norm = getattr(getattr(gpt, "decoder", None), "final_layernorm", None)
        if final_norm is not None:
            self.handles.append(final_norm.register_forward_hook(self._final_norm_hook))

    def arm(self) -> None:
        self.captured.clear()
        self.armed = {"output_layer"} if self.output_layer_seen else {"output_layer",
                                                                      "final_norm"}

    def _keep(self, source: str, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        if source in self.armed:
            self.armed.discard(source)
            self.captured[source] = (hidden.detach().clone(), weight.detach().clone())

    def _output_layer_hook(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["input_"]
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        self.output_layer_seen = True
        self._keep("output_layer", hidden, module.weight if weight is None else weight)

    def _final_norm_hook(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        gpt = self.gpt
        weight = gpt.shared_embedding_or_output_weight() \
            if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight
        self._keep("final_norm", hidden, weight)

    def take(self) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(hidden (N, D), weight (V, D), source); hidden rows in Megatron's [s, b] order."""
        for source in ("output_layer", "final_norm"):
            if source in self.captured:
                hidden, weight = self.captured.pop(source)
                self.captured.clear()
                return hidden.reshape(-1, hidden.shape[-1]), weight, source
        raise RuntimeError("the probe saw no forward through the output layer this step")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def observed(batches, seen: SeenTokens | None, first: dict | None):
    """The micro-batches, counting their tokens into ``seen`` and keeping the first one's
    labels in ``first``."""
    for i, batch in enumerate(batches):
        if seen is not None:
            seen.observe(batch)
        if first is not None and i == 0:
            first["labels"] = batch["labels"]
        yield batch


def _probe_impl() -> str:
    """The probes run our kernels where they can run (CUDA, or the CPU under the interpreter);
    elsewhere the chunked PyTorch path, which has no filter to measure."""
    from fused_lce.kernels.common import INTERPRET

    return "cce" if torch.cuda.is_available() or INTERPRET else "chunked"


def run_probe(args, tap: OutputLayerTap, first: dict, seen: SeenTokens) -> dict:
    """The probe record of this step's first micro-batch (lce_train.grad_probe).

    A probe is a diagnostic on one rank, outside training: if it fails, the record holds the
    error and training goes on (the traceback is printed).
    """
    from lce_train.grad_probe import probe_loss_layer

    t0 = time.perf_counter()
    try:
        hidden, weight, source = tap.take()
        labels = first.pop("labels").transpose(0, 1).reshape(-1)  # [b, s] -> Megatron's [s, b]
        record = probe_loss_layer(hidden, weight, labels, unseen=seen.unseen(),
                                  softcap=args.model.logit_softcap, impl=_probe_impl())
        del hidden, weight
    except Exception as err:  # reported in the record; training continues
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}"[:500]}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {**record, "impl": _probe_impl(), "source": source,
            "seconds": time.perf_counter() - t0}


def _eval_loss_func(loss_mask, unseen_targets, output_tensor):
    """As :func:`loss_func`, also summing the loss over targets unseen in training."""
    loss, num_tokens, report = loss_func(loss_mask, output_tensor)
    if unseen_targets is not None:
        mask = loss_mask.float() * unseen_targets.float()
        report["unseen loss"] = torch.stack([(output_tensor.float() * mask).sum().detach(),
                                             mask.sum().detach()])
    return loss, num_tokens, report


def _eval_forward_step(unseen, data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    targets = None if unseen is None else unseen[batch["labels"]]
    return output, partial(_eval_loss_func, batch["loss_mask"], targets)


def evaluate(args, model, valid: TokenWindows, dp_rank: int, device, dp_cp_group,
             unseen: torch.Tensor | None) -> dict:
    """Validation loss over ``--eval-iters`` global batches of fixed held-out windows, with
    megatron's forward-only schedule; RNG states are restored, so training does not notice.

    Returns (on the last pipeline stage; {} elsewhere) {"valid_loss"} and, given ``unseen``,
    {"valid_unseen_targets": count, "valid_unseen_loss": their mean loss (None if none)}.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    rng = rng_state()
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    model.eval()
    try:
        with torch.no_grad():
            for j in range(args.eval_iters):
                reduced = forward_backward(**supported_kwargs(
                    forward_backward,
                    forward_step_func=partial(_eval_forward_step, unseen),
                    data_iterator=valid.microbatches(j + 1, args, dp_rank, device),
                    model=[model], num_microbatches=args.num_microbatches,
                    seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                    decoder_seq_length=args.seq_length, forward_only=True,
                ))
                for r in reduced or []:
                    totals[:2] += r["lm loss"].to(device, torch.float64)
                    if "unseen loss" in r:
                        totals[2:] += r["unseen loss"].to(device, torch.float64)
    finally:
        model.train()
        set_rng_state(rng)
    if not parallel_state.is_pipeline_last_stage():
        return {}
    torch.distributed.all_reduce(totals, group=dp_cp_group)
    result = {"valid_loss": float(totals[0] / totals[1].clamp(min=1))}
    if unseen is not None:
        count = int(totals[3])
        result["valid_unseen_targets"] = count
        result["valid_unseen_loss"] = float(totals[2] / count) if count else None
    return result


def probe_line(step: int, probe: dict) -> str:
    if "error" in probe:
        return f"probe       step {step}: failed ({probe['error']})"
    errors = ", ".join(f"{name} {e['input']:.1e}/{e['weight']:.1e}"
                       for name, e in probe["grad_rel_err"].items())
    return (f"probe       step {step}: loss-layer grad rel. err (input/weight) {errors}; "
            f"unseen mass {probe['unseen_mass']:.2e} ({probe['unseen_ids']} ids); "
            f"{probe['seconds']:.2f} s")
