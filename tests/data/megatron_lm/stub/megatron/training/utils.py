"""Written for fused_lce's tests, NOT Megatron-LM's file: the five names that Megatron-LM's
arguments.py imports from megatron/training/utils.py, whose real module needs megatron.legacy
and the whole training package. Behaviour as the real ones on a single CPU process."""

import warnings


def print_rank_0(message, rank=None):
    if rank in (None, 0):
        print(message, flush=True)


def warn_rank_0(message, rank=None):
    if rank in (None, 0):
        warnings.warn(message, stacklevel=2)


def is_rank0():
    return True


def get_device_arch_version():
    # validate_args asks for the GPU generation; the test stands in for a Hopper (9).
    return 9


def update_use_dist_ckpt(args):
    args.use_dist_ckpt = args.ckpt_format != "torch"
