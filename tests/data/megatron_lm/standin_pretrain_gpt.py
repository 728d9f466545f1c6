"""Stands in for Megatron-LM's pretrain_gpt.py in tests/megatron/test_megatron_lm.py (written for
fused_lce's tests): the parses Megatron-LM runs, in its order, then the model config it builds
from them. No model, no data, no GPU.

With STANDIN_INSTALL=1 it adds the one line a user would add at the top of pretrain_gpt.py.
It prints one line, ``STANDIN {json}``, with what each step saw.
"""

import json
import os

from megatron.training import arguments

# initialize.py (0.16, 0.17) imports these by name: a patch of the module attribute misses them.
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_global_variables

if os.environ.get("STANDIN_INSTALL") == "1":
    from fused_lce.parallel.megatron_lm import install; install()  # noqa: E702, I001

if __name__ == "__main__":
    seen = {}
    # inprocess_restart.maybe_wrap_for_inprocess_restart, and ft_integration: no provider.
    seen["first_parse"] = arguments.parse_args(ignore_unknown_args=True).cross_entropy_fusion_impl
    # The script's own parse: parse_and_validate_args (0.18+) or initialize_megatron (0.16, 0.17).
    if hasattr(arguments, "parse_and_validate_args"):
        args = arguments.parse_and_validate_args(
            args_defaults={"tokenizer_type": "GPT2BPETokenizer"}
        )
    else:
        args = parse_args(None, False)
        validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        set_global_variables(args, build_tokenizer=False)
    seen["validated"] = args.cross_entropy_fusion_impl
    config = arguments.core_transformer_config_from_args(args)
    seen["config"] = [config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl]

    from megatron.core.models.gpt import GPTModel

    from fused_lce.parallel import megatron as lce_megatron
    from fused_lce.parallel.megatron_lm import options_from_megatron_lm

    # A script that also passes our provider, as the docs of fused_lce 0.1 asked.
    seen["with_provider"] = arguments.parse_args(
        extra_args_provider=lce_megatron.extra_args_provider, ignore_unknown_args=True
    ).cross_entropy_fusion_impl
    seen["wants_cce"] = lce_megatron.wants_cce(config)
    seen["options"] = options_from_megatron_lm()
    seen["gpt_patched"] = getattr(GPTModel._postprocess, "_fused_lce_patched", False)
    print("STANDIN " + json.dumps(seen), flush=True)
