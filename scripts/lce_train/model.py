"""Distributed set-up and the model: megatron-core's parallel groups, the GPTModel of this
pipeline stage wrapped as Megatron-LM does, and the step function its schedules run.

megatron-core is imported inside the functions, so that ``--help`` and ``--dry-run`` work
without it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from functools import partial

import torch

from fused_lce.parallel import megatron_patch
from lce_train import full_iteration
from lce_train.arguments import cce_options
from lce_train.signatures import supported_kwargs


def quiet_known_warnings() -> None:
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


def init_distributed(args) -> None:
    """torch.distributed from torchrun's environment, then megatron's parallel groups."""
    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:
            raise SystemExit("run under torchrun, one process per rank: torchrun "
                             "--nproc-per-node N -m lce_train.training FLAGS (N = TP x PP x CP x "
                             "DP); or pass --dry-run to print the plan without running it")
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
    init(**supported_kwargs(init, tensor_model_parallel_size=sizes[0],
                             pipeline_model_parallel_size=sizes[1],
                             context_parallel_size=sizes[2]))


def transformer_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = args.model
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
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
    # megatron-core 0.19+ know full_iteration here (TE's cross entropy then skips its host
    # checks); 0.16-0.18 name only per-layer graphs, which the launcher does not make.
    if "full_iteration" in str(getattr(fields.get("cuda_graph_impl"), "type", "")):
        kwargs["cuda_graph_impl"] = args.cuda_graph_impl
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
        return fn(config, **supported_kwargs(fn, use_transformer_engine=True,
                                              normalization=args.normalization))

    from lce_train.megatron_norms import MegatronNorm

    fn = gpt_layer_specs.get_gpt_layer_local_spec
    layer = fn(**supported_kwargs(fn, normalization=args.normalization))
    layer.submodules = dataclasses.replace(
        layer.submodules, input_layernorm=MegatronNorm, pre_mlp_layernorm=MegatronNorm)
    if args.local_attention == "sdpa":
        from lce_train.megatron_attention import SDPAttention

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
    gpt = GPTModel(**supported_kwargs(
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
    ddp_config = DistributedDataParallelConfig(**supported_kwargs(
        DistributedDataParallelConfig,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    ))
    with full_iteration.ddp_stream(args.cuda_graph_impl == "full_iteration"):
        model = DistributedDataParallel(**supported_kwargs(
            DistributedDataParallel.__init__, config=config, ddp_config=ddp_config,
            module=model))
    if args.uses_cce:
        # Stages without the output layer keep their ordinary path.
        megatron_patch.install(model, **cce_options(args))
    return model, gpt


def loss_func(loss_mask, output_tensor):
    """Mask and sum the per-token loss [b, s]; megatron divides by the token count."""
    losses = output_tensor.float()
    mask = loss_mask.float()
    loss = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), mask.sum().detach()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = get_batch_on_this_cp_rank(batch)  # this rank's 2 load-balanced sequence chunks
    # The loss mask lets cce compute its gradients in the forward (the mask loss_func applies).
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])
