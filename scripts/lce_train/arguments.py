"""The launcher's flags and the resolved plan: pure Python, used by ``--dry-run`` and checked
against megatron-core when the model is built.

:func:`build_parser` declares Megatron's flag names (plus ours: the ``--cce-*`` options of
fused_lce's op, evaluation and probes); :func:`resolve` fills what the model config implies and
refuses impossible layouts before anything is built; :func:`describe` prints the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os

import torch

from fused_lce.parallel import megatron_flags
from lce_train.configs import known_models, load_model_config
from lce_train.data import check_data_vocab, describe_blend
from lce_train.pp_split import stage_layer_counts

IMPLS_MEGATRON = ("native", "te")


def _te_importable() -> bool:
    """transformer-engine is on the path (found, not imported: a broken TE install must not
    break --help)."""
    return importlib.util.find_spec("transformer_engine") is not None


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
                        "the GPU; lce_train.megatron_attention)")

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
    g.add_argument("--cuda-graph-impl", choices=("none", "full_iteration"), default="none",
                   help="full_iteration: after the warm-up steps, capture the forward and "
                        "backward of every micro-batch as one CUDA graph and replay it each "
                        "step (megatron-core's FullCudaGraphWrapper, as Megatron-LM's flag); "
                        "the optimizer step stays eager. CUDA only, one pipeline stage")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="eager steps before the capture (Triton compiles and tunes in them)")

    g = p.add_argument_group("data")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--mock-data", action="store_true",
                     help="seeded synthetic sequences (the default when no --data-path)")
    src.add_argument("--data-path", nargs="+", default=None,
                     help="Megatron indexed dataset: PREFIX (PREFIX.bin + PREFIX.idx, from "
                          "Megatron-LM's tools/preprocess_data.py or lce-build-token-file)"
                          ", or a blend 'W1 PREFIX1 W2 PREFIX2 ...' as in Megatron-LM")
    g.add_argument("--data-cache-path", default=None,
                   help="where megatron's GPTDataset keeps its index caches (default: cache/ "
                        "beside the data)")

    # One flag per option of the op, derived from LCEOptions (the same flags as Megatron-LM's
    # route, fused_lce.parallel.megatron_lm).
    megatron_flags.add_cce_arguments(
        p, "cce options (with --cross-entropy-fusion-impl cce or linear)")

    g = p.add_argument_group("evaluation and probes")
    g.add_argument("--valid-data-path", nargs="+", default=None,
                   help="validation indexed dataset (a prefix or a blend, as --data-path; with "
                        "--mock-data: a held-out stream of the same distribution)")
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
    g.add_argument("--profile-step", type=int, default=None,
                   help="trace this step with torch.profiler: each rank writes a Chrome trace "
                        "and a summary (GPU busy time, the costliest ops) into --profile-dir")
    g.add_argument("--profile-dir", default="profile",
                   help="where --profile-step writes (default: ./profile)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the resolved configuration and layout, build nothing")

    megatron_flags.add_arguments(p)
    return p


def cce_options(args) -> dict:
    """The options ``fused_lce.parallel.megatron_patch.install`` passes to the op: the model's
    final-logit softcap, then the --cce-* flags given (an explicit --cce-softcap wins)."""
    options = {"softcap": args.model.logit_softcap} if args.model.logit_softcap else {}
    options.update(megatron_flags.cce_options_from_args(args))
    if getattr(args, "cuda_graph_impl", "none") == "full_iteration":
        # The whole step is replayed: the op's own graphs, captured in the warm-up steps, would
        # never run again and only hold their memory (as in fused_lce.parallel.megatron_lm).
        options["cuda_graphs"] = False
    return options


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
    args.uses_cce = impl in megatron_flags.CCE_CHOICES
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
    if args.profile_step is not None and not 1 <= args.profile_step <= args.train_iters:
        raise SystemExit(f"--profile-step {args.profile_step} must be a step of this run, 1 to "
                         f"--train-iters {args.train_iters}")
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
        check_data_vocab(args.data_path, "--data-path", args.model.vocab_size)
    if args.save_interval is not None and args.save is None:
        raise SystemExit("--save-interval needs --save DIR")
    _check_eval_and_probes(args)
    _check_cuda_graphs(args)
    return args


def _check_cuda_graphs(args) -> None:
    if args.cuda_graph_impl != "full_iteration":
        return
    if args.cuda_graph_warmup_steps < 1:
        raise SystemExit("--cuda-graph-warmup-steps must be >= 1 with --cuda-graph-impl "
                         f"full_iteration (the kernels compile in eager steps), got "
                         f"{args.cuda_graph_warmup_steps}")
    if args.pipeline_model_parallel_size > 1:
        raise SystemExit("--cuda-graph-impl full_iteration needs --pipeline-model-parallel-size "
                         "1: megatron-core's non-interleaved pipeline schedule synchronises the "
                         "device after each transfer, which a capture cannot hold")
    if args.probe_interval:
        raise SystemExit("--probe-interval reads the output layer's inputs on chosen steps, "
                         "which a replayed graph does not do: drop it or --cuda-graph-impl")
    if args.distributed_backend != "nccl":
        raise SystemExit("--cuda-graph-impl full_iteration needs CUDA GPUs and the nccl "
                         f"backend, got backend {args.distributed_backend}")


def _check_eval_and_probes(args) -> None:
    given = megatron_flags.cce_options_from_args(args)
    if not args.uses_cce and given:
        flags = " / ".join(megatron_flags.cce_flag(name) for name in given)
        raise SystemExit(f"{flags} act on fused_lce's op: "
                         "use them with --cross-entropy-fusion-impl cce or linear")
    try:
        megatron_flags.check_cce_options(cce_options(args))
    except ValueError as err:
        raise SystemExit(str(err)) from None
    for flag in ("eval_interval", "eval_iters", "probe_interval"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if args.valid_data_path is not None:
        check_data_vocab(args.valid_data_path, "--valid-data-path", args.model.vocab_size)
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
        f"data        {'mock (seeded)' if args.mock_data else describe_blend(args.data_path)}, "
        f"{args.train_iters} steps, seed {args.seed}",
        f"checkpoint  save {args.save or '-'} (every {args.save_interval or 'end'}), "
        f"load {args.load or '-'}",
    ]
    if args.cuda_graph_impl == "full_iteration":
        lines.append(f"cuda graphs full iteration: forward and backward captured after "
                     f"{args.cuda_graph_warmup_steps} eager steps, then replayed")
    if args.eval_interval:
        source = describe_blend(args.valid_data_path) if args.valid_data_path else \
            "held-out mock stream"
        lines.append(f"evaluation  every {args.eval_interval} steps and at the end: "
                     f"{args.eval_iters} global batches of {source}")
    if args.probe_interval:
        unseen = "zero count in the training file" if args.data_path else \
            "not drawn by this run so far"
        lines.append(f"probes      step 1, every {args.probe_interval} steps and the end: "
                     f"loss-layer gradients vs fp32 reference; unseen tokens = {unseen}")
    return "\n".join(lines)
