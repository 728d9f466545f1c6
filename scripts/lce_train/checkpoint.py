"""Checkpoints through megatron-core's ``dist_checkpointing``: sharded, and resumable at another
parallel layout.

A checkpoint is Megatron-LM's layout on disk::

    SAVE/latest_checkpointed_iteration.txt    the last complete step, e.g. "10"
    SAVE/iter_0000010/                        one dist_checkpointing folder (torch_dist backend):
        metadata.json, common.pt, __<rank>_<n>.distcp, .metadata

Each rank writes its shards of the model (``GPTModel.sharded_state_dict``) and of the optimizer
(``optimizer.sharded_state_dict``: Adam's moments and the fp32 main parameters, keyed by the
model parameter they belong to), so a run saved at one TP / PP / DP layout loads at another; the
distributed optimizer's state is saved as ``fully_reshardable`` (gathered per parameter over the
data-parallel group), which reloads at any layout (``lce_train.checkpoint_optimizer``).

What resumes with it: the step, the model, the optimizer, and per rank the RNG states (CPU, CUDA
and megatron's tracker) when the layout is the same (then a resumed run repeats an unbroken one
bitwise). The data need no state: the batch of step k is a function of the seed, k and the global
batch size (``lce_train.data``), so the global batch size must stay the same.

The vocabulary must stay the same too, padding included: Megatron pads it to a multiple of
``--make-vocab-size-divisible-by`` x TP and every padded row is a class of the softmax, so a
resume at another TP that pads to another size would compute another loss (dist_checkpointing
reads a smaller slice of the saved rows without a word). The checkpoint records the vocabulary
(``vocab``: true and padded size, divisible-by, TP) and a run whose vocabulary differs is refused,
naming the flag that reproduces the checkpoint's padding.

The launcher's earlier format (one ``torch.save`` file per rank, ``iter_*/rank_*.pt``) is not
read: its folders are refused with a message naming them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from lce_train.checkpoint_optimizer import (
    SHARDING_METADATA,
    load_optimizer,
    optimizer_sharded_state,
)

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT = "lce_train dist_checkpointing v1"


def rng_state():
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def layout(args) -> dict:
    return {"world": args.world_size, "tp": args.tensor_model_parallel_size,
            "pp": args.pipeline_model_parallel_size, "cp": args.context_parallel_size}


def iteration_folder(root, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def vocab(args) -> dict:
    """What the rows of the embedding and output layer stand for: the true vocabulary size, the
    padded one (the rows), and the divisible-by and TP that padded it."""
    return {"size": args.model.vocab_size, "padded": args.padded_vocab_size,
            "divisible_by": args.make_vocab_size_divisible_by,
            "tp": args.tensor_model_parallel_size}


def _sharded_state(args, step, gpt, optimizer, *, loading: bool, with_rng: bool) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject

    from lce_train.signatures import supported_kwargs

    fn = gpt.sharded_state_dict
    model_sd = fn(prefix="", **supported_kwargs(fn, metadata=SHARDING_METADATA))
    state = {
        "format": FORMAT,
        "iteration": step,
        "layout": layout(args),
        "global_batch_size": args.global_batch_size,
        "seed": args.seed,
        "vocab": vocab(args),
        "model": model_sd,
        "optimizer": optimizer_sharded_state(optimizer, model_sd, loading),
    }
    if with_rng:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        state["rng_state"] = ShardedObject("rng_state", rng_state(), (world,), (rank,),
                                           replica_id=0)
    return state


# ---------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------


def _tolerate_missing_psutil() -> None:
    """megatron-core's torch_dist writer reads the process's memory through psutil only to log it
    at debug level, and raises without psutil (not among megatron-core's requirements): log 0."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not getattr(filesystem_async, "HAVE_PSUTIL", True):
        filesystem_async._process_memory = lambda: 0


def save_checkpoint(args, step, gpt, optimizer) -> None:
    """Write SAVE/iter_<step>/ (all ranks), then the tracker file (rank 0)."""
    from megatron.core import dist_checkpointing

    _tolerate_missing_psutil()

    rank = torch.distributed.get_rank()
    folder = iteration_folder(args.save, step)
    if rank == 0:
        if folder.exists():
            shutil.rmtree(folder)  # the same step saved again: dist_checkpointing wants it empty
        folder.mkdir(parents=True)
    torch.distributed.barrier()
    state = _sharded_state(args, step, gpt, optimizer, loading=False, with_rng=True)
    dist_checkpointing.save(state, str(folder))
    torch.distributed.barrier()
    if rank == 0:
        # Written last and atomically: a crash mid-save leaves the previous step as the latest.
        tmp = Path(args.save) / (TRACKER + ".tmp")
        tmp.write_text(f"{step}\n")
        tmp.replace(Path(args.save) / TRACKER)
    torch.distributed.barrier()


def latest_step(root: Path) -> int:
    """The step in ROOT/latest_checkpointed_iteration.txt, with an error naming what is wrong."""
    if not root.is_dir():
        raise SystemExit(f"--load {root}: no such directory")
    tracker = root / TRACKER
    if not tracker.is_file():
        saved = sorted(p.name for p in root.glob("iter_*"))
        hint = f" (it holds {', '.join(saved[-3:])}: pass --ckpt-step N)" if saved else \
            " (not a checkpoint directory written by --save)"
        raise SystemExit(f"--load {root}: {tracker} not found{hint}")
    text = tracker.read_text().strip()
    try:
        step = int(text)
    except ValueError:
        found = "an empty file" if not text else repr(text[:40])
        raise SystemExit(f"{tracker}: expected the number of the last saved step (as Megatron-LM "
                         f"writes it), found {found}; fix it or pass --ckpt-step N") from None
    if step < 0:
        raise SystemExit(f"{tracker}: step {step} is negative")
    return step


def check_checkpoint_folder(folder: Path) -> None:
    """Refuse a folder that is not a complete dist_checkpointing checkpoint, naming it."""
    from megatron.core import dist_checkpointing

    if not folder.is_dir():
        raise SystemExit(f"--load: {folder} does not exist")
    if any(folder.glob("rank_*.pt")):
        raise SystemExit(f"{folder} holds per-rank torch.save files (rank_*.pt), the launcher's "
                         "format before megatron-core's dist_checkpointing; that format is not "
                         "read any more: train again from the start, or load it with an earlier "
                         "fused_lce at the same layout")
    if not dist_checkpointing.check_is_distributed_checkpoint(str(folder)):
        raise SystemExit(f"{folder}: not a dist_checkpointing checkpoint "
                         f"({folder / 'metadata.json'} is missing: the save did not finish, or "
                         "this is not a checkpoint)")


def _load_common(folder: Path) -> dict:
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(str(folder))
    except Exception as err:  # a missing or unreadable common.pt
        raise SystemExit(f"{folder}: cannot read the checkpoint's common state "
                         f"({folder / 'common.pt'}): {type(err).__name__}: {err}") from None
    if common.get("format") != FORMAT:
        raise SystemExit(f"{folder}: a dist_checkpointing checkpoint, but not one of this launcher "
                         f"(format {common.get('format')!r}, expected {FORMAT!r})")
    return common


# ---------------------------------------------------------------------------------------------
# The vocabulary: the same true size and the same padding, or refused
# ---------------------------------------------------------------------------------------------

# The rows of this tensor are the padded vocabulary in every checkpoint of the launcher.
EMBEDDING_KEY = "embedding.word_embeddings.weight"


def _saved_vocab(folder: Path, common: dict) -> dict:
    """The checkpoint's vocabulary record; for one saved before the launcher wrote it, the padded
    size read off the embedding's global shape (the true size is not known then)."""
    if "vocab" in common:
        return common["vocab"]
    from megatron.core import dist_checkpointing

    embedding = dist_checkpointing.load_tensors_metadata(str(folder)).get(EMBEDDING_KEY)
    padded = embedding.global_shape[0] if embedding is not None else None
    return {"size": None, "padded": padded, "divisible_by": None, "tp": common["layout"]["tp"]}


def divisible_by_for(padded: int, size: int, tp: int, preferred: int | None = None) -> int | None:
    """The --make-vocab-size-divisible-by that pads SIZE tokens to PADDED rows at TP, or None if
    none does: PREFERRED if it does (the checkpoint's multiple, divisible-by x its TP, spread over
    this TP, so the padding keeps its rule), else the smallest.

    N does when PADDED is the first multiple of N x TP at or above SIZE, the rule of
    lce_train.arguments.padded_vocab_size (written out, not imported, so that this module keeps
    to the imports docs/architecture.md draws).
    """
    def pads(n: int) -> bool:
        multiple = n * tp
        return padded % multiple == 0 and padded - multiple < size <= padded

    if preferred and pads(preferred):
        return preferred
    return next((n for n in range(1, padded // tp + 1) if pads(n)), None)


def _padding_fix(saved: dict, size: int, tp: int) -> str:
    """What to pass so that this run pads the vocabulary as the checkpoint did."""
    padded = saved["padded"]
    if size > padded:  # a checkpoint saved before its vocabulary was recorded
        return (f"the checkpoint has fewer rows than this run's {size} tokens: pass the "
                "--vocab-size it was saved with")
    multiple = (saved["divisible_by"] or 0) * (saved["tp"] or 0)
    n = divisible_by_for(padded, size, tp, multiple // tp if multiple % tp == 0 else None)
    if n is not None:
        return (f"pass --make-vocab-size-divisible-by {n} so that the padded vocabulary is "
                f"{padded} as in the checkpoint")
    return (f"no --make-vocab-size-divisible-by N pads {size} tokens to {padded} rows at TP {tp} "
            f"(padded = ceil({size} / (N x TP)) x N x TP): resume at a TP size that divides "
            f"{padded}, with N = {padded} / TP")


def _padding_text(padded, divisible_by, tp) -> str:
    rule = f"--make-vocab-size-divisible-by {divisible_by} x TP {tp}" if divisible_by \
        else f"TP {tp}"
    return f"{padded} rows ({rule})"


def check_vocab(folder: Path, saved: dict, args) -> None:
    """Refuse a checkpoint whose vocabulary is not this run's, before any weight is read.

    Every padded row is a class of the softmax, so another padding is another loss; and
    dist_checkpointing reads the rows asked for, cutting the saved ones short without a word when
    this run pads to fewer.
    """
    size, padded, tp = args.model.vocab_size, args.padded_vocab_size, \
        args.tensor_model_parallel_size
    if saved["size"] is not None and saved["size"] != size:
        raise SystemExit(f"{folder} was saved with a vocabulary of {saved['size']} tokens, this "
                         f"run has {size}: pass --vocab-size {saved['size']} (or the model "
                         "config it was saved with); its rows were trained for that vocabulary")
    if saved["padded"] is not None and saved["padded"] != padded:
        was = _padding_text(saved["padded"], saved["divisible_by"], saved["tp"])
        now = _padding_text(padded, args.make_vocab_size_divisible_by, tp)
        raise SystemExit(f"{folder} was saved with the vocabulary padded to {was}, this run "
                         f"pads its {size} tokens to {now}: the padded rows are classes of the "
                         f"softmax, so the loss would change; {_padding_fix(saved, size, tp)}")


def _first_line(err: BaseException) -> str:
    """The first line of what went wrong, looking inside torch's per-rank CheckpointException."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        err = next(iter(failures.values()))
        if isinstance(err, tuple):  # torch keeps each rank's (exception, traceback summary)
            err = err[0]
    return f"{type(err).__name__}: {err}".splitlines()[0][:400]


def load_checkpoint(args, gpt, optimizer, log=print) -> int:
    """Restore model, optimizer (and RNG at the same layout) from ``--load``; returns the step to
    continue after."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(args.load)
    step = args.ckpt_step if args.ckpt_step is not None else latest_step(root)
    folder = iteration_folder(root, step)
    check_checkpoint_folder(folder)
    common = _load_common(folder)
    if common["global_batch_size"] != args.global_batch_size:
        raise SystemExit(f"{folder} was saved with --global-batch-size "
                         f"{common['global_batch_size']}, this run has {args.global_batch_size}: "
                         "the data position is step-addressed, keep the global batch size")
    check_vocab(folder, _saved_vocab(folder, common), args)
    same_layout = common["layout"] == layout(args)
    request = _sharded_state(args, step, gpt, optimizer, loading=True, with_rng=same_layout)
    try:
        loaded = dist_checkpointing.load(request, str(folder))
    # Missing shard files, mismatched shapes or keys; torch.distributed.checkpoint reports its
    # ranks' failures as a CheckpointException, a BaseException.
    except (Exception, CheckpointException) as err:
        first = _first_line(err)
        raise SystemExit(f"{folder}: cannot load the checkpoint at this layout {layout(args)} "
                         f"(saved at {common['layout']}): {first}") from None
    gpt.load_state_dict(loaded["model"])
    load_optimizer(optimizer, loaded["optimizer"])
    if same_layout:
        set_rng_state(loaded["rng_state"])
    else:
        log(f"note        {folder} was saved at layout {common['layout']}, this run is "
            f"{layout(args)}: model and optimizer resharded; RNG states start from the seed")
    return int(common["iteration"])
