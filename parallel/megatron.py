"""The megatron-core adapter's public import path (docs/megatron.md), in two parts:

- :mod:`fused_lce.parallel.megatron_patch`: :func:`install` routes the loss of GPT models whose
  config asks for ``--cross-entropy-fusion-impl cce`` (alias ``linear``) through our op;
- :mod:`fused_lce.parallel.megatron_flags`: :func:`extra_args_provider` and the other helpers
  that add ``cce`` and the ``--cce-*`` flags to a parser and read them back.

Users write ``fused_lce.parallel.megatron.install(model, softcap=30.0)`` or pass
``extra_args_provider=fused_lce.parallel.megatron.extra_args_provider``; our own code imports
the part it uses. Importing this module imports neither megatron nor Megatron-LM.
"""

from .megatron_flags import (
    ADAPTER_OPTIONS,
    CCE_CHOICES,
    CCE_FLAG_PREFIX,
    add_arguments,
    add_cce_arguments,
    cce_flag,
    cce_options_from_args,
    check_cce_options,
    extra_args_provider,
)
from .megatron_patch import DeferredLogits, install, wants_cce

__all__ = [
    "ADAPTER_OPTIONS",
    "CCE_CHOICES",
    "CCE_FLAG_PREFIX",
    "DeferredLogits",
    "add_arguments",
    "add_cce_arguments",
    "cce_flag",
    "cce_options_from_args",
    "check_cce_options",
    "extra_args_provider",
    "install",
    "wants_cce",
]
