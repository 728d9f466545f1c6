#!/usr/bin/env python
"""Pretrain a GPT on megatron-core with the vocab-parallel Cut Cross-Entropy loss.

A self-contained pretraining entry for users of megatron-core without Megatron-LM: tensor,
sequence, pipeline (1F1B) and data parallelism from megatron-core, the model shape from
``configs/models/<name>.yaml``, Megatron's flag names, and the loss layer chosen with
``--cross-entropy-fusion-impl {native,te,cce,linear}``; ``cce`` and ``linear`` compute the loss
with fused_lce's vocab-parallel op and never build the logits (``fused_lce.parallel.megatron``
installs it on the model).

Single node (8 GPUs, NCCL):

    torchrun --nproc-per-node 8 scripts/pretrain_gpt.py --config llama3_8b \\
        --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \\
        --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split \\
        --micro-batch-size 1 --global-batch-size 64 --seq-length 4096 --bf16 \\
        --cross-entropy-fusion-impl cce --mock-data --train-iters 100

Multi-node (run the same line on every node; c10d rendezvous assigns ranks):

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \\
        --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id my-job \\
        scripts/pretrain_gpt.py --config llama3_8b ...

CPU (gloo; megatron-core's CUDA-only calls are redirected by fused_lce.parallel.megatron_cpu):

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py --config tiny \\
        --tensor-model-parallel-size 2 --cross-entropy-fusion-impl cce --mock-data --train-iters 5

``--dry-run`` prints the resolved configuration and layout and builds nothing (no torchrun
needed; ``--world-size`` says how many ranks to plan for). ``scripts/pretrain_gpt.sh`` wraps
the torchrun lines; ``scripts/compare_losses.py`` runs ``cce`` beside ``native``.

The backend is NCCL on CUDA and gloo on the CPU. Every rank that holds the last pipeline stage
computes the loss; tensor-parallel rank 0 of data-parallel rank 0 there prints one line per step:
step, loss, learning rate, tokens/s, step time and the peak memory of every pipeline stage
(``torch.cuda.max_memory_allocated`` on GPUs, the process's peak RSS on the CPU).

Checkpoints (``--save DIR --save-interval K``, ``--load DIR``) are one ``torch.save`` file per
rank holding the model, the optimizer, the RNG states and the step; a resumed run continues the
same loss curve (bitwise on the CPU). Data come from ``--mock-data`` (seeded synthetic token
sequences) or ``--data-path PREFIX`` (a flat token file ``PREFIX.bin`` with ``PREFIX.json``
from scripts/build_token_file.py), sampled as seeded random windows: the batch of step k
depends only on the seed and k, so a resumed run sees the same data.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import resource
import sys
import time
import traceback
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import torch

from fused_lce.configs import known_models, load_model_config
from fused_lce.parallel import megatron as lce_megatron
from fused_lce.pp_memory import stage_layer_counts

IMPLS_MEGATRON = ("native", "te")
# Generator seeds of the held-out (validation) windows start here, far above any training seed's
# stream (seed * 1_000_003 + sample index).
HELD_OUT_STREAM = 2**62


def _te_importable() -> bool:
    """transformer-engine is on the path (found, not imported: a broken TE install must not
    break --help)."""
    return importlib.util.find_spec("transformer_engine") is not None


# ----------------------------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Pretrain a GPT on megatron-core with fused_lce's vocab-parallel loss.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--config", default="tiny",
                   help=f"model shape: a name in configs/models ({', '.join(known_models())}) "
                        "or a path to a .yaml")
    g.add_argument("--num-layers", type=int, default=None, help="override the config")
    g.add_argument("--hidden-size", type=int, default=None, help="override the config")
    g.add_argument("--vocab-size", type=int, default=None, help="override the config")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="override the config")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="override the config's key/value heads (TP must divide them)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None,
                   help="separate output layer (default: from the config's tie_embeddings)")
    g.add_argument("--normalization", choices=("RMSNorm", "LayerNorm"), default="RMSNorm")
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"),
                   default="rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times TP, as Megatron does")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialize full weights on the CPU, then shard (TP-size invariant)")
    default_impl = "transformer_engine" if _te_importable() and torch.cuda.is_available() \
        else "local"
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"),
                   default=default_impl,
                   help="layer implementation; transformer_engine only where it is importable")
    g.add_argument("--local-attention", choices=("unfused", "sdpa"), default="unfused",
                   help="core attention of the local layers: megatron-core's DotProductAttention "
                        "(keeps the scores) or torch's scaled_dot_product_attention (flash on "
                        "the GPU; fused_lce.parallel.megatron_attention)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer + loss as one layer when splitting stages")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer when splitting stages")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the first pipeline stage (uneven split)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the last pipeline stage (uneven split)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over data-parallel ranks (ZeRO-1)")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl on CUDA, gloo on the CPU")
    g.add_argument("--world-size", type=int, default=None,
                   help="ranks to plan for in --dry-run (default: $WORLD_SIZE, else TP*PP*CP)")

    g = p.add_argument_group("loss")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="fused cross entropy (implied by cce and linear)")
    g.add_argument("--cross-entropy-fusion-impl", choices=list(IMPLS_MEGATRON), default="native",
                   help="native / te: megatron-core's; cce / linear: fused_lce, no logits")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data-parallel size (one micro-batch)")
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"),
                   default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters (Float16Module)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--optimizer-impl", choices=("auto", "megatron", "torch"), default="auto",
                   help="megatron: get_megatron_optimizer; torch: plain AdamW; auto: megatron, "
                        "falling back to torch where it fails (bf16 on the CPU)")

    g = p.add_argument_group("data")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--mock-data", action="store_true",
                     help="seeded synthetic sequences (the default when no --data-path)")
    src.add_argument("--data-path", default=None,
                     help="token file prefix: PREFIX.bin (flat uint16/uint32) + PREFIX.json")

    # One flag per option of the op, derived from LCEOptions (the same flags as Megatron-LM's
    # route, fused_lce.parallel.megatron_lm).
    lce_megatron.add_cce_arguments(
        p, "cce options (with --cross-entropy-fusion-impl cce or linear)")

    g = p.add_argument_group("evaluation and probes")
    g.add_argument("--valid-data-path", default=None,
                   help="validation token file prefix (with --mock-data: a held-out stream of the "
                        "same distribution)")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss every K steps and at the end (default: never)")
    g.add_argument("--eval-iters", type=int, default=10,
                   help="global batches per evaluation, the same held-out windows every time")
    g.add_argument("--probe-interval", type=int, default=None,
                   help="at step 1, every K steps and at the end, compare the loss layer's "
                        "gradients on one micro-batch with an fp32 full-logits reference and "
                        "measure the probability of tokens unseen in training; evaluations then "
                        "also report the loss on unseen targets (TP=1, CP=1)")

    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every K steps (and at the end); default: only at the end")
    g.add_argument("--load", default=None, help="resume from this directory")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="step to load (default: the latest in --load)")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--log-json", default=None,
                   help="also append one JSON object per step to this file")
    g.add_argument("--dry-run", action="store_true",
                   help="print the resolved configuration and layout, build nothing")

    lce_megatron.add_arguments(p)
    return p


# ----------------------------------------------------------------------------------------------
# The resolved plan (pure Python: used by --dry-run and checked against megatron at build time)
# ----------------------------------------------------------------------------------------------


def cce_options(args) -> dict:
    """The options ``fused_lce.parallel.megatron.install`` passes to the op: the model's
    final-logit softcap, then the --cce-* flags given (an explicit --cce-softcap wins)."""
    options = {"softcap": args.model.logit_softcap} if args.model.logit_softcap else {}
    return {**options, **lce_megatron.cce_options_from_args(args)}


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return ((vocab + multiple - 1) // multiple) * multiple


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill config-derived defaults into ``args`` and check the layout; returns ``args``."""
    cfg = load_model_config(args.config)
    overrides = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "vocab_size",
                                               "ffn_hidden_size", "num_query_groups")
                 if getattr(args, k) is not None}
    args.model = dataclasses.replace(cfg, **overrides)
    if args.untie_embeddings_and_output_weights is None:
        args.untie_embeddings_and_output_weights = not cfg.tie_embeddings
    impl = args.cross_entropy_fusion_impl
    args.uses_cce = impl in lce_megatron.CCE_CHOICES
    if args.uses_cce:
        args.cross_entropy_loss_fusion = True  # our op replaces the fused loss
    if args.transformer_impl == "transformer_engine" and not _te_importable():
        raise SystemExit("--transformer-impl transformer_engine: transformer_engine is not "
                         "importable here; use --transformer-impl local")
    if args.local_attention != "unfused" and args.transformer_impl != "local":
        raise SystemExit(f"--local-attention {args.local_attention} needs --transformer-impl "
                         "local (transformer_engine brings its own attention)")
    if impl == "te" and not _te_importable():
        raise SystemExit("--cross-entropy-fusion-impl te needs transformer_engine")

    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", tp * pp * cp))
    if world % (tp * pp * cp):
        raise SystemExit(f"world size {world} is not divisible by TP*PP*CP = {tp * pp * cp}")
    args.world_size = world
    m = args.model
    if m.num_attention_heads % tp or m.num_query_groups % tp:
        raise SystemExit(f"--tensor-model-parallel-size {tp} must divide the attention heads "
                         f"({m.num_attention_heads}) and the key/value groups "
                         f"({m.num_query_groups}) of {m.name}; --num-query-groups overrides "
                         "the groups")
    args.data_parallel_size = world // (tp * pp * cp)
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # megatron turns SP off at TP=1 too
    if args.sequence_parallel and args.seq_length % (tp * cp):
        raise SystemExit(f"--sequence-parallel needs --seq-length divisible by TP*CP={tp * cp}")
    if cp > 1 and args.seq_length % (2 * cp):
        raise SystemExit(f"--context-parallel-size {cp} needs --seq-length divisible by {2 * cp}")
    if cp > 1 and args.transformer_impl != "transformer_engine":
        raise SystemExit("--context-parallel-size > 1 needs transformer_engine attention "
                         "(megatron-core's local attention has no context parallelism)")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                         f"micro batch x DP = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    try:
        args.stage_layers = stage_layer_counts(
            args.model.num_layers, pp, args.decoder_first_pipeline_num_layers,
            args.decoder_last_pipeline_num_layers, args.account_for_embedding_in_pipeline_split,
            args.account_for_loss_in_pipeline_split)
    except ValueError as err:
        raise SystemExit(f"pipeline split: {err}") from None
    args.padded_vocab_size = padded_vocab_size(args.model.vocab_size,
                                               args.make_vocab_size_divisible_by, tp)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not args.mock_data and args.data_path is None:
        args.mock_data = True
    if args.data_path is not None:
        meta = _token_file_meta(args.data_path)
        if meta["vocab_size"] > args.model.vocab_size:
            raise SystemExit(f"{args.data_path}: token vocabulary {meta['vocab_size']} exceeds "
                             f"the model's {args.model.vocab_size}; pass --vocab-size "
                             f"{meta['vocab_size']}")
    if args.save_interval is not None and args.save is None:
        raise SystemExit("--save-interval needs --save DIR")
    _check_eval_and_probes(args)
    return args


def _check_eval_and_probes(args) -> None:
    given = lce_megatron.cce_options_from_args(args)
    if not args.uses_cce and given:
        flags = " / ".join(lce_megatron.cce_flag(name) for name in given)
        raise SystemExit(f"{flags} act on fused_lce's op: "
                         "use them with --cross-entropy-fusion-impl cce or linear")
    try:
        lce_megatron.check_cce_options(cce_options(args))
    except ValueError as err:
        raise SystemExit(str(err)) from None
    for flag in ("eval_interval", "eval_iters", "probe_interval"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if args.valid_data_path is not None:
        meta = _token_file_meta(args.valid_data_path)
        if meta["vocab_size"] > args.model.vocab_size:
            raise SystemExit(f"{args.valid_data_path}: token vocabulary {meta['vocab_size']} "
                             f"exceeds the model's {args.model.vocab_size}")
    if args.eval_interval and args.data_path is not None and args.valid_data_path is None:
        raise SystemExit("--eval-interval with --data-path needs --valid-data-path (held-out "
                         "text); mock data draws its held-out stream itself")
    if args.probe_interval:
        layout = (args.tensor_model_parallel_size, args.context_parallel_size)
        if layout != (1, 1):
            raise SystemExit("--probe-interval compares the whole loss layer on one rank: it "
                             "needs --tensor-model-parallel-size 1 and --context-parallel-size 1")
        if args.mock_data and args.data_parallel_size > 1:
            raise SystemExit("--probe-interval with --mock-data counts the tokens this rank "
                             "draws to know which are unseen: it needs data-parallel size 1")


def parse_args(argv=None) -> argparse.Namespace:
    return resolve(build_parser().parse_args(argv))


def parameter_count(args) -> int:
    m = args.model
    attn = m.hidden_size * m.kv_channels * (m.num_attention_heads + 2 * m.num_query_groups) \
        + m.num_attention_heads * m.kv_channels * m.hidden_size
    mlp = 3 * m.hidden_size * m.ffn_hidden_size
    per_layer = attn + mlp + 2 * m.hidden_size
    embed = args.padded_vocab_size * m.hidden_size
    output = embed if args.untie_embeddings_and_output_weights else 0
    return embed + m.num_layers * per_layer + m.hidden_size + output


def describe(args) -> str:
    """The resolved configuration and layout, as printed by --dry-run and at start-up."""
    m = args.model
    pp = args.pipeline_model_parallel_size
    lines = [
        f"model       {m.name}: {m.num_layers} layers, hidden {m.hidden_size}, "
        f"{m.num_attention_heads} heads ({m.num_query_groups} kv groups x {m.kv_channels}), "
        f"ffn {m.ffn_hidden_size}, vocab {m.vocab_size} (padded {args.padded_vocab_size}), "
        f"{'untied' if args.untie_embeddings_and_output_weights else 'tied'} embeddings, "
        f"{args.normalization}, {args.position_embedding_type}, "
        f"~{parameter_count(args) / 1e6:.1f}M parameters",
    ]
    if m.logit_softcap:
        applied = "applied by the cce loss" if args.uses_cce else \
            "not applied (megatron-core's GPTModel has no final-logit soft-capping; cce applies it)"
        lines.append(f"note        logit_softcap={m.logit_softcap}: {applied}")
    lines += [
        f"parallel    world {args.world_size} = TP {args.tensor_model_parallel_size} x "
        f"PP {pp} x CP {args.context_parallel_size} x DP {args.data_parallel_size}; "
        f"sequence parallel {'on' if args.sequence_parallel else 'off'}; "
        f"backend {args.distributed_backend}; layers {args.transformer_impl}",
    ]
    for stage, n in enumerate(args.stage_layers):
        parts = []
        if stage == 0:
            parts.append("embedding")
        parts.append(f"{n} transformer layer{'s' if n != 1 else ''}")
        if stage == pp - 1:
            parts.append(f"final norm + output layer + loss ({args.cross_entropy_fusion_impl})")
        lines.append(f"  stage {stage}   " + ", ".join(parts))
    counted = [name for name, on in (("embedding", args.account_for_embedding_in_pipeline_split),
                                     ("loss", args.account_for_loss_in_pipeline_split)) if on]
    if args.decoder_first_pipeline_num_layers or args.decoder_last_pipeline_num_layers:
        split = "uneven (first/last stage layers given)"
    elif counted:
        split = " and ".join(counted) + " counted as layers"
    else:
        split = "even"
    if pp > 1:
        lines.append(f"  split     {split}; schedule 1F1B with {args.num_microbatches} "
                     f"micro-batches")
    fused = "fused" if args.cross_entropy_loss_fusion else "unfused"
    op_options = ""
    if args.uses_cce and (args.cce_impl or args.cce_backward or args.cce_filter_eps):
        op_options = f"; impl {args.cce_impl or 'default'}, backward " \
                     f"{args.cce_backward or 'default'}, filter {args.cce_filter_eps or 'default'}"
    lines += [
        f"loss        {args.cross_entropy_fusion_impl} ({fused}"
        f"{', fused_lce vocab-parallel op, no logits' if args.uses_cce else ''}{op_options})",
        f"batch       micro {args.micro_batch_size} x DP {args.data_parallel_size} x "
        f"{args.num_microbatches} micro-batches = global {args.global_batch_size} sequences "
        f"of {args.seq_length} = {args.global_batch_size * args.seq_length} tokens/step",
        f"optimizer   AdamW ({args.optimizer_impl}) lr {args.lr:g} -> {args.min_lr:g} "
        f"({args.lr_decay_style}, warmup {args.lr_warmup_iters}), wd {args.weight_decay:g}, "
        f"clip {args.clip_grad:g}, {'bf16' if args.bf16 else 'fp32'} params"
        f"{', distributed' if args.use_distributed_optimizer else ''}",
        f"data        {'mock (seeded)' if args.mock_data else args.data_path}, "
        f"{args.train_iters} steps, seed {args.seed}",
        f"checkpoint  save {args.save or '-'} (every {args.save_interval or 'end'}), "
        f"load {args.load or '-'}",
    ]
    if args.eval_interval:
        source = args.valid_data_path or "held-out mock stream"
        lines.append(f"evaluation  every {args.eval_interval} steps and at the end: "
                     f"{args.eval_iters} global batches of {source}")
    if args.probe_interval:
        unseen = "zero count in the training file" if args.data_path else \
            "not drawn by this run so far"
        lines.append(f"probes      step 1, every {args.probe_interval} steps and the end: "
                     f"loss-layer gradients vs fp32 reference; unseen tokens = {unseen}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


def _token_file_meta(prefix: str) -> dict:
    path = Path(prefix)
    if path.suffix in (".bin", ".json"):
        path = path.with_suffix("")
    meta_path = path.with_suffix(".json")
    if not meta_path.exists() or not path.with_suffix(".bin").exists():
        raise SystemExit(f"--data-path {prefix}: expected {path}.bin and {path}.json "
                         "(see scripts/build_token_file.py)")
    meta = json.loads(meta_path.read_text())
    meta["bin"] = str(path.with_suffix(".bin"))
    return meta


class TokenWindows:
    """Seeded random windows of ``seq_length + 1`` tokens; sample i depends only on (seed, i).

    Mock data (no file): independent tokens with Zipf frequencies (p(rank r) ~ 1 / r) over a
    seeded permutation of the vocabulary, like word frequencies in text: the loss falls from
    ln(V) towards the distribution's entropy within tens of steps. File data: a window at a
    random offset of the token file.

    ``held_out=True`` draws the validation windows: sample i then depends only on i (the same
    windows in every run, whatever its seed), from a generator stream that training never uses;
    mock data keep the seed's vocabulary permutation, so they follow the training distribution.
    """

    def __init__(self, seq_length: int, vocab_size: int, seed: int, data_path: str | None,
                 held_out: bool = False):
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.stream = HELD_OUT_STREAM if held_out else seed * 1_000_003
        self.tokens = None
        ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
        self.zipf = (1.0 / ranks) / (1.0 / ranks).sum()
        self.zipf_ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
        if data_path is not None:
            meta = _token_file_meta(data_path)
            self.tokens = np.memmap(meta["bin"], dtype=np.dtype(meta["dtype"]), mode="r")
            if len(self.tokens) <= seq_length + 1:
                raise SystemExit(f"{meta['bin']}: {len(self.tokens)} tokens, fewer than one "
                                 f"window of {seq_length + 1}")

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.stream + index)
        n = self.seq_length + 1
        if self.tokens is None:
            return self.zipf_ids[torch.multinomial(self.zipf, n, replacement=True,
                                                   generator=gen)]
        offset = int(torch.randint(len(self.tokens) - n, (1,), generator=gen))
        return torch.from_numpy(self.tokens[offset: offset + n].astype(np.int64))

    def microbatches(self, step: int, args, dp_rank: int, device):
        """The micro-batches of ``step`` (1-based) on data-parallel rank ``dp_rank``."""
        mbs, dp = args.micro_batch_size, args.data_parallel_size
        base = (step - 1) * args.global_batch_size
        positions = torch.arange(self.seq_length, device=device).repeat(mbs, 1)
        for m in range(args.num_microbatches):
            first = base + m * mbs * dp + dp_rank * mbs
            windows = torch.stack([self.sample(first + k) for k in range(mbs)]).to(device)
            yield {
                "tokens": windows[:, :-1].contiguous(),
                "labels": windows[:, 1:].contiguous(),
                "loss_mask": torch.ones(mbs, self.seq_length, dtype=torch.float32,
                                        device=device),
                "position_ids": positions,
            }


# ----------------------------------------------------------------------------------------------
# Distributed set-up and the model
# ----------------------------------------------------------------------------------------------


def _quiet_known_warnings() -> None:
    """Silence warnings that are expected here and carry no information for this launcher."""
    for pattern in (
        # megatron-core at import, without apex / TE: the fallbacks are what we use on purpose.
        ".*Apex is not installed.*", ".*Transformer Engine and Apex are not installed.*",
        ".*Transformer Engine is not installed.*",
        # megatron-core 0.16's own TransformerConfig default trips its deprecation warning.
        ".*full scope is deprecated.*",
        # a CUDA tuning hint, also printed on the CPU.
        ".*CUDA_DEVICE_MAX_CONNECTIONS.*",
        # torch 2.13 deprecates all_gather_into_tensor (used by parallel/comm.py and megatron).
        ".*all_gather_into_tensor.* is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _supported_kwargs(fn, **kwargs) -> dict:
    """``kwargs`` restricted to the parameters ``fn`` takes (megatron-core signatures drift)."""
    return {k: v for k, v in kwargs.items() if _accepts(fn, k)}


def init_distributed(args) -> None:
    """torch.distributed from torchrun's environment, then megatron's parallel groups."""
    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:
            raise SystemExit("run under torchrun (see the docstring), or pass --dry-run")
        if args.distributed_backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group(backend=args.distributed_backend)
    world = torch.distributed.get_world_size()
    if world != args.world_size:
        raise SystemExit(f"planned for {args.world_size} ranks but running on {world}")

    from megatron.core import parallel_state

    sizes = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
             args.context_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_context_parallel_world_size())
        if current == sizes:
            return
        parallel_state.destroy_model_parallel()
    init = parallel_state.initialize_model_parallel
    init(**_supported_kwargs(init, tensor_model_parallel_size=sizes[0],
                             pipeline_model_parallel_size=sizes[1],
                             context_parallel_size=sizes[2]))


def transformer_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = args.model
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization=args.normalization,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        use_cpu_initialization=args.use_cpu_initialization,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        calculate_per_token_loss=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
    )
    missing = [k for k, v in kwargs.items() if k not in fields and v not in (None, False, 0.0)]
    layout_fields = ("account_for_loss_in_pipeline_split", "num_layers_in_first_pipeline_stage",
                     "num_layers_in_last_pipeline_stage",
                     "account_for_embedding_in_pipeline_split")
    unsupported = [k for k in missing if k in layout_fields]
    if unsupported:
        raise SystemExit(f"this megatron-core has no TransformerConfig field(s) {unsupported}; "
                         "drop the matching pipeline-split flags")
    return TransformerConfig(**{k: v for k, v in kwargs.items() if k in fields})


def layer_spec(args, config):
    """The decoder block spec: megatron's local (or TE) layer with a norm that supports SP."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if args.transformer_impl == "transformer_engine":
        fn = gpt_layer_specs.get_gpt_decoder_block_spec
        return fn(config, **_supported_kwargs(fn, use_transformer_engine=True,
                                              normalization=args.normalization))

    from fused_lce.parallel.megatron_norms import MegatronNorm

    fn = gpt_layer_specs.get_gpt_layer_local_spec
    layer = fn(**_supported_kwargs(fn, normalization=args.normalization))
    layer.submodules = dataclasses.replace(
        layer.submodules, input_layernorm=MegatronNorm, pre_mlp_layernorm=MegatronNorm)
    if args.local_attention == "sdpa":
        from fused_lce.parallel.megatron_attention import SDPAttention

        attention = layer.submodules.self_attention
        attention.submodules = dataclasses.replace(
            attention.submodules, core_attention=SDPAttention)
    count = get_num_layers_to_build(config)
    from megatron.core import parallel_state

    expected = args.stage_layers[parallel_state.get_pipeline_model_parallel_rank()]
    if count != expected:
        raise RuntimeError(f"megatron builds {count} layers on this stage, the plan says "
                           f"{expected}: stage_layer_counts() disagrees with this megatron-core")
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=MegatronNorm)


def build_model(args, config):
    """GPTModel for this pipeline stage, wrapped as Megatron-LM does: Float16Module (bf16), DDP.

    Returns:
        (model, gpt): the wrapped model the schedule runs, and the bare GPTModel.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel

    pre = parallel_state.is_pipeline_first_stage()
    post = parallel_state.is_pipeline_last_stage()
    gpt = GPTModel(**_supported_kwargs(
        GPTModel.__init__,
        config=config,
        transformer_layer_spec=layer_spec(args, config),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    ))
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    model = gpt
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(**_supported_kwargs(
        DistributedDataParallelConfig,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    ))
    model = DistributedDataParallel(**_supported_kwargs(
        DistributedDataParallel.__init__, config=config, ddp_config=ddp_config, module=model))
    if args.uses_cce:
        # Stages without the output layer keep their ordinary path.
        lce_megatron.install(model, **cce_options(args))
    return model, gpt


# ----------------------------------------------------------------------------------------------
# Optimizer
# ----------------------------------------------------------------------------------------------


def learning_rate(args, step: int) -> float:
    """Linear warmup, then decay towards --min-lr; a pure function of the 1-based step, so a
    resumed run continues exactly. As in megatron's scheduler, step k decays by k - 1 steps:
    the first step after warmup runs at --lr, and --min-lr is reached after --lr-decay-iters."""
    if args.lr_warmup_iters and step <= args.lr_warmup_iters:
        return args.lr * step / args.lr_warmup_iters
    if args.lr_decay_style == "constant":
        return args.lr
    span = max(1, args.lr_decay_iters - args.lr_warmup_iters)
    frac = min(1.0, max(0.0, (step - 1 - args.lr_warmup_iters) / span))
    if args.lr_decay_style == "linear":
        coef = 1.0 - frac
    else:
        coef = 0.5 * (1.0 + math.cos(math.pi * frac))
    return args.min_lr + (args.lr - args.min_lr) * coef


class TorchAdamW:
    """Plain ``torch.optim.AdamW`` behind the interface the loop uses from megatron's optimizers.

    Used where megatron's optimizer cannot run (its bf16 path checks for ``torch.cuda.*Tensor``
    types). Gradients come from DDP's ``main_grad`` buffers; with bf16 parameters the optimizer
    keeps fp32 master copies. The gradient norm counts each parameter once across TP ranks
    (megatron's duplicate and shared-parameter rules) and is reduced over the model-parallel
    group, so clipping matches megatron's.
    """

    def __init__(self, args, model):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() if p.dtype != torch.float32 else p
                       for p in self.params]
        decay = [i for i, p in enumerate(self.params) if p.dim() > 1]
        no_decay = [i for i, p in enumerate(self.params) if p.dim() <= 1]
        groups = [{"params": [self.master[i] for i in decay], "wd_mult": 1.0},
                  {"params": [self.master[i] for i in no_decay], "wd_mult": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=args.lr, weight_decay=args.weight_decay,
            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
        self.clip = args.clip_grad
        self.counted = [param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
                        for p in self.params]
        self.group = parallel_state.get_model_parallel_group()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None

    def step(self):
        grads = []
        for p, m in zip(self.params, self.master):
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            m.grad = None if g is None else g.detach().float()
            grads.append(m.grad)
        sq = torch.zeros((), dtype=torch.float64, device=self.master[0].device)
        for g, counted in zip(grads, self.counted):
            if g is not None and counted:
                sq += g.double().pow(2).sum()
        torch.distributed.all_reduce(sq, group=self.group)
        norm = float(sq.sqrt())
        if self.clip > 0 and norm > self.clip:
            for g in grads:
                if g is not None:
                    g.mul_(self.clip / (norm + 1e-6))
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if p is not m:
                    p.copy_(m)
        return True, norm, None


def build_optimizer(args, model, config):
    """megatron's get_megatron_optimizer, or TorchAdamW where that is asked for or fails."""
    if args.optimizer_impl in ("auto", "megatron"):
        try:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            opt_config = OptimizerConfig(**_supported_kwargs(
                OptimizerConfig,
                optimizer="adam", lr=args.lr, min_lr=args.min_lr,
                weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                bf16=args.bf16, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                use_distributed_optimizer=args.use_distributed_optimizer,
            ))
            optimizer = get_megatron_optimizer(opt_config, [model])
            config.grad_scale_func = optimizer.scale_loss
            return optimizer, "megatron"
        except Exception as err:  # megatron's bf16 optimizer checks for torch.cuda tensor types
            if args.optimizer_impl == "megatron" or args.use_distributed_optimizer:
                raise
            reason = f"{type(err).__name__}: {err}".splitlines()[0][:160]
    else:
        reason = "--optimizer-impl torch"
    config.grad_scale_func = None
    return TorchAdamW(args, model), f"torch AdamW ({reason})"


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------


def _rng_state():
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _layout(args) -> dict:
    return {"world": args.world_size, "tp": args.tensor_model_parallel_size,
            "pp": args.pipeline_model_parallel_size, "cp": args.context_parallel_size}


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (chained, fp32, mixed-precision, distributed) or
    our TorchAdamW; their parameters are this rank's fp32 main parameters (or shards)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for opt in chained for inner in _inner_optimizers(opt)]
    return [optimizer.optimizer]


def _optimizer_state(optimizer) -> list[dict]:
    """Per rank: each inner optimizer's state and its main parameters' values.

    Checkpoints here are per rank and need the same layout to resume, so the rank's own shard of
    the optimizer is saved as is; megatron's distributed optimizer would otherwise gather it.
    """
    return [{"state": inner.state_dict(),
             "main_params": [p.detach().clone() for g in inner.param_groups for p in g["params"]]}
            for inner in _inner_optimizers(optimizer)]


def _load_optimizer_state(optimizer, saved: list[dict]) -> None:
    inners = _inner_optimizers(optimizer)
    if len(inners) != len(saved):
        raise SystemExit(f"checkpoint holds {len(saved)} optimizer(s), this run has {len(inners)}")
    for inner, entry in zip(inners, saved):
        inner.load_state_dict(entry["state"])
        params = [p for g in inner.param_groups for p in g["params"]]
        with torch.no_grad():
            for p, value in zip(params, entry["main_params"], strict=True):
                p.copy_(value)


def save_checkpoint(args, step, gpt, optimizer) -> None:
    rank = torch.distributed.get_rank()
    folder = Path(args.save) / f"iter_{step:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({
        "step": step,
        "layout": _layout(args),
        "model": gpt.state_dict(),
        "optimizer": _optimizer_state(optimizer),
        "rng": _rng_state(),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))},
    }, folder / f"rank_{rank:05d}.pt")
    torch.distributed.barrier()
    if rank == 0:
        (Path(args.save) / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    torch.distributed.barrier()


def load_checkpoint(args, gpt, optimizer) -> int:
    """Restore model, optimizer and RNG from ``--load``; returns the step to continue after."""
    root = Path(args.load)
    step = args.ckpt_step
    if step is None:
        tracker = root / "latest_checkpointed_iteration.txt"
        if not tracker.exists():
            raise SystemExit(f"--load {root}: no latest_checkpointed_iteration.txt")
        step = int(tracker.read_text().strip())
    path = root / f"iter_{step:07d}" / f"rank_{torch.distributed.get_rank():05d}.pt"
    if not path.exists():
        raise SystemExit(f"--load: {path} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["layout"] != _layout(args):
        raise SystemExit(f"{path} was saved with layout {state['layout']}, this run is "
                         f"{_layout(args)}: resume with the same parallel layout")
    gpt.load_state_dict(state["model"])
    _load_optimizer_state(optimizer, state["optimizer"])
    _set_rng_state(state["rng"])
    return int(state["step"])


# ----------------------------------------------------------------------------------------------
# The training loop
# ----------------------------------------------------------------------------------------------


def _loss_func(loss_mask, output_tensor):
    """Mask and sum the per-token loss [b, s]; megatron divides by the token count."""
    losses = output_tensor.float()
    mask = loss_mask.float()
    loss = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), mask.sum().detach()])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = get_batch_on_this_cp_rank(batch)  # this rank's 2 load-balanced sequence chunks
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


# ----------------------------------------------------------------------------------------------
# Evaluation and probes (docs/training_equivalence.md)
# ----------------------------------------------------------------------------------------------


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
            meta = _token_file_meta(args.data_path)
            tokens = np.memmap(meta["bin"], dtype=np.dtype(meta["dtype"]), mode="r")
            counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=self.vocab)
            self.counts = torch.from_numpy(counts).to(device)
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


def _observed(batches, seen: SeenTokens | None, first: dict | None):
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
    """The probe record of this step's first micro-batch (fused_lce.grad_probe).

    A probe is a diagnostic on one rank, outside training: if it fails, the record holds the
    error and training goes on (the traceback is printed).
    """
    from fused_lce.grad_probe import probe_loss_layer

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
    """As :func:`_loss_func`, also summing the loss over targets unseen in training."""
    loss, num_tokens, report = _loss_func(loss_mask, output_tensor)
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
    rng = _rng_state()
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    model.eval()
    try:
        with torch.no_grad():
            for j in range(args.eval_iters):
                reduced = forward_backward(**_supported_kwargs(
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
        _set_rng_state(rng)
    if not parallel_state.is_pipeline_last_stage():
        return {}
    torch.distributed.all_reduce(totals, group=dp_cp_group)
    result = {"valid_loss": float(totals[0] / totals[1].clamp(min=1))}
    if unseen is not None:
        count = int(totals[3])
        result["valid_unseen_targets"] = count
        result["valid_unseen_loss"] = float(totals[2] / count) if count else None
    return result


def _peak_memory() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _allocated_memory() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _per_stage_gib(value: int, device, pp_rank: int, pp: int) -> list[float]:
    """A memory figure (bytes on this rank) of each pipeline stage: the max over its ranks."""
    mine = torch.zeros(pp, dtype=torch.float64, device=device)
    mine[pp_rank] = value / 2**30
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    return mine.tolist()


def build_training(args):
    """The seeded model and its optimizer, wired to megatron's schedules (after
    :func:`init_distributed`). Returns (model, gpt, optimizer, optimizer name)."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import finalize_model_grads

    torch.manual_seed(args.seed)
    seed_fn = tensor_parallel.model_parallel_cuda_manual_seed
    seed_fn(args.seed, **_supported_kwargs(seed_fn, force_reset_rng=True))
    config = transformer_config(args)
    model, gpt = build_model(args, config)
    optimizer, optimizer_name = build_optimizer(args, model, config)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return model, gpt, optimizer, optimizer_name


def train(args, log=print) -> list[dict]:
    """Build everything from ``args`` (resolved), train, and return the per-step records.

    The records (step, loss, lr, grad_norm, tokens_per_s, step_s, per stage: peak_gib and
    resident_gib, what is allocated when a step starts) are
    returned on the reporting rank (last pipeline stage, TP rank 0, DP rank 0); other ranks
    return an empty list. Callable more than once in a process (scripts/compare_losses.py).
    """
    from fused_lce.parallel.megatron_cpu import applied, enable_cpu_mode

    _quiet_known_warnings()
    cpu_mode = enable_cpu_mode()
    init_distributed(args)

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    last_stage = parallel_state.is_pipeline_last_stage()
    dp_rank = parallel_state.get_data_parallel_rank()
    # Loss sums and token counts add up over data- and context-parallel ranks.
    get_dp_group = parallel_state.get_data_parallel_group
    dp_cp_group = get_dp_group(**_supported_kwargs(get_dp_group, with_context_parallel=True))
    reporter = (last_stage and parallel_state.get_tensor_model_parallel_rank() == 0
                and dp_rank == 0)
    say = log if reporter else (lambda *a, **k: None)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")

    model, gpt, optimizer, optimizer_name = build_training(args)

    say(describe(args))
    say(f"optimizer   {optimizer_name}")
    if cpu_mode:
        say(f"cpu mode    {len(applied())} megatron-core patches (fused_lce.parallel.megatron_cpu)")

    start = 0
    if args.load:
        start = load_checkpoint(args, gpt, optimizer)
        say(f"resumed     from {args.load} at step {start}")

    data = TokenWindows(args.seq_length, args.model.vocab_size, args.seed, args.data_path)
    valid = None
    if args.eval_interval:
        valid = TokenWindows(args.seq_length, args.model.vocab_size, args.seed,
                             args.valid_data_path, held_out=True)
    seen = SeenTokens(args, device) if args.probe_interval and last_stage else None
    tap = OutputLayerTap(gpt) if args.probe_interval and reporter else None
    first_batch: dict = {}
    # The peak of training steps only: evaluation and probes forget theirs (on GPUs).
    training_peak = 0
    forward_backward = get_forward_backward_func()
    history = []
    json_log = None
    if args.log_json and reporter:
        Path(args.log_json).parent.mkdir(parents=True, exist_ok=True)
        json_log = open(args.log_json, "a")
    try:
        for step in range(start + 1, args.train_iters + 1):
            lr = learning_rate(args, step)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
                group["weight_decay"] = args.weight_decay * group.get("wd_mult", 1.0)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            resident = _allocated_memory()  # weights, gradient buffers, optimizer states
            probing = tap is not None and _due(step, args.probe_interval, args.train_iters, True)
            batches = data.microbatches(step, args, dp_rank, device)
            if probing:
                tap.arm()
            if seen is not None or probing:
                batches = _observed(batches, seen, first_batch if probing else None)
            reduced = forward_backward(**_supported_kwargs(
                forward_backward,
                forward_step_func=_forward_step, data_iterator=batches, model=[model],
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                forward_only=False,
            ))
            ok, grad_norm, _ = optimizer.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0

            loss = float("nan")
            if last_stage:
                total = torch.stack([r["lm loss"] for r in reduced]).sum(0).to(device)
                torch.distributed.all_reduce(total, group=dp_cp_group)
                loss = (total[0] / total[1].clamp(min=1)).item()
            training_peak = max(training_peak, _peak_memory())
            pp = args.pipeline_model_parallel_size
            peaks = _per_stage_gib(training_peak, device, pp_rank, pp)
            resident = _per_stage_gib(resident, device, pp_rank, pp)
            record = {
                "step": step, "loss": loss, "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens_per_s": args.global_batch_size * args.seq_length / step_s,
                "step_s": step_s, "peak_gib": peaks, "resident_gib": resident,
                "skipped": not ok,
            }
            if valid is not None and _due(step, args.eval_interval, args.train_iters):
                t_eval = time.perf_counter()
                unseen = None if seen is None else seen.unseen()
                record.update(evaluate(args, model, valid, dp_rank, device, dp_cp_group, unseen))
                record["eval_s"] = time.perf_counter() - t_eval
                _forget_peak()
            if probing:
                record["probe"] = run_probe(args, tap, first_batch, seen)
                _forget_peak()
                say(_probe_line(step, record["probe"]))
            if reporter:
                history.append(record)
                if json_log is not None:
                    json_log.write(json.dumps({**record, "impl": args.cross_entropy_fusion_impl})
                                   + "\n")
                    json_log.flush()
            if step % args.log_interval == 0 or step == args.train_iters:
                mem = " ".join(f"{g:.2f}" for g in peaks)
                valid_text = f" | valid {record['valid_loss']:.6f}" if "valid_loss" in record \
                    else ""
                say(f"step {step:>6}/{args.train_iters} | loss {loss:.6f}{valid_text} | "
                    f"lr {lr:.3e} | grad norm {record['grad_norm'] or 0:.3f} | "
                    f"{record['tokens_per_s']:,.0f} tok/s | {step_s:.3f} s | "
                    f"peak GiB per stage [{mem}]")
            if args.save and ((args.save_interval and step % args.save_interval == 0)
                              or step == args.train_iters):
                save_checkpoint(args, step, gpt, optimizer)
                say(f"saved       {args.save}/iter_{step:07d}")
    finally:
        if json_log is not None:
            json_log.close()
        if tap is not None:
            tap.remove()
    return history


def _due(step: int, interval: int | None, last: int, at_first: bool = False) -> bool:
    """Whether a periodic action runs at ``step``: every ``interval`` steps and at the end (and
    at step 1 with ``at_first``)."""
    if not interval:
        return False
    return step % interval == 0 or step == last or (at_first and step == 1)


def _forget_peak() -> None:
    """Start the device's peak-memory counter afresh, so that buffers of evaluation and probes
    do not count as training memory (the CPU's peak RSS cannot be reset)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _probe_line(step: int, probe: dict) -> str:
    if "error" in probe:
        return f"probe       step {step}: failed ({probe['error']})"
    errors = ", ".join(f"{name} {e['input']:.1e}/{e['weight']:.1e}"
                       for name, e in probe["grad_rel_err"].items())
    return (f"probe       step {step}: loss-layer grad rel. err (input/weight) {errors}; "
            f"unseen mass {probe['unseen_mass']:.2e} ({probe['unseen_ids']} ids); "
            f"{probe['seconds']:.2f} s")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        print(describe(args))
        return
    if importlib.util.find_spec("megatron.core") is None:
        raise SystemExit(
            "pretrain_gpt.py needs megatron-core (--cross-entropy-fusion-impl "
            f"{args.cross_entropy_fusion_impl}): pip install -e .[megatron]"
        )
    train(args)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
