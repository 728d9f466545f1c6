"""Written for fused_lce's tests, NOT Megatron-LM's file: the global arguments of
megatron/training/global_vars.py (get_args, set_global_variables) without tokenizer, timers and
loggers."""

_GLOBAL_ARGS = None


def get_args():
    assert _GLOBAL_ARGS is not None, "args is not initialized."
    return _GLOBAL_ARGS


def set_global_variables(args, build_tokenizer=True):
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args
