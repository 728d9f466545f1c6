"""lce_train: our megatron-core launcher and the studies around fused_lce (not the op itself).

The op is ``fused_lce`` (with ``fused_lce.parallel``); this package trains with it and measures
it. It may import the op; the op never imports it. megatron-core (``pip install .[megatron]``) is
imported inside the functions that need it, so every module here imports without it.

The launcher (scripts/pretrain_gpt.py, ``lce-pretrain-gpt``), in the order a run goes through it:
    arguments            flags, the resolved plan and ``--dry-run``'s description
    data                 mock tokens, or Megatron indexed datasets and blends (megatron-core's)
    model                parallel groups, the GPTModel of a stage, the schedule's step function
    optimizer            learning-rate schedule, megatron's optimizer or plain AdamW
    checkpoint           dist_checkpointing save and resume, at any parallel layout
    checkpoint_optimizer the optimizer's sharded state in a checkpoint, and its loading
    evaluation           validation loss and the gradient probes' hooks
    training             the loop and ``main``
    megatron_cpu         megatron-core on the CPU (gloo): a test shim, never part of the op
    megatron_attention   SDPA core attention for megatron-core's local layers
    megatron_norms       RMSNorm / LayerNorm for megatron-core's local layers
Studies and tools, each a command (below) with its library beside it:
    configs              model shapes (the top-level configs/ folder, YAML as package data)
    pp_memory            the per-stage pipeline memory model
    pp_split             megatron's layer-split rules and the split recommender over pp_memory
    grad_probe           the loss layer's gradient error against an fp32 reference
    equivalence_*        training_equivalence's parts: config, run, logs, report, plots
    bench_parallel_*     bench_parallel's baselines (megatron's losses) and per-rank timers
    bench_lce_*          scripts/bench_lce.py's providers, inputs and timers (one GPU; the
                         studies in scripts/studies/ use them too)
    compare_losses, pp_memory_balance, max_micro_batch, training_equivalence, build_token_file,
    megatron_lm_report, plot_gpu_suite, bench_parallel

Every module with a ``main`` is a command two ways: ``python -m lce_train.<module>`` and the
console script that setup.py installs (``lce-pp-memory-balance``; ``lce-pretrain-gpt`` for
``training``, which a checkout also runs as ``python scripts/pretrain_gpt.py``, Megatron-LM's
name). Either imports this package as installed (editable or wheel): the source folder has no
``configs``, which the install maps in.
"""
