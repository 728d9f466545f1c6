"""Megatron-LM's own training scripts with ``--cross-entropy-fusion-impl cce``, unmodified.

Run a script through this module and it trains with fused_lce's loss::

    python -m fused_lce.parallel.megatron_lm pretrain_gpt.py --cross-entropy-loss-fusion \\
        --cross-entropy-fusion-impl cce [--cce-softcap 30 ...] ARGS...
    torchrun --nproc-per-node 2 -m fused_lce.parallel.megatron_lm pretrain_gpt.py ...

or call :func:`install` once at the top of the script. Either way, before the script parses its
command line:

- every ``GPTModel`` built afterwards is patched
  (:func:`fused_lce.parallel.megatron_patch.install`); the op's options are the ``--cce-*`` flags
  of the parsed command line, read from Megatron-LM's global arguments at the first cce loss;
- every parser Megatron-LM builds gets ``cce``/``linear`` among the choices of
  ``--cross-entropy-fusion-impl`` and the ``--cce-*`` flags.

Why the second point patches Megatron-LM rather than passing an ``extra_args_provider``:
Megatron-LM 0.16 to 0.19 parse the command line more than once.
``inprocess_restart.maybe_wrap_for_inprocess_restart`` and ``ft_integration`` call
``arguments.parse_args(ignore_unknown_args=True)`` with no provider before the script's own
parse, and argparse checks the choices of a known flag even then, so ``cce`` fails there. Every
one of those parsers is built by ``megatron.training.arguments.parse_args``, which calls the
module's ``add_megatron_arguments``; wrapping that module attribute reaches them all, also where
``parse_args`` itself was imported by name (``initialize.py`` in 0.16 and 0.17). The module's
``parse_args`` is wrapped too, so bad ``--cce-*`` values fail at the first parse.

Nothing else in Megatron-LM checks the value: ``cross_entropy_fusion_impl`` is a
``Literal['native', 'te']`` on ``ModelParallelConfig`` that no code validates at run time
(``__post_init__`` only refuses ``'te'`` with the fusion on, in 0.18+); ``validate_args`` does the
same; ``load_args_from_checkpoint`` copies named fields, not this one, and parses nothing.
A ``--yaml-cfg`` run replaces the parsed namespace by the YAML file's and is not covered.

Each training step also starts by raising any fault the op found on the device in an earlier
step (fused_lce/faults.py; a host-memory read, no sync). Under ``--cuda-graph-impl
full_iteration`` the op's own Python runs only until the capture, so this is where a bad
target or an unexpected upstream gradient of a replayed step is raised.

It also lets ``--cuda-graph-impl full_iteration`` run with pipeline parallelism, for any
loss: megatron-core 0.19's ``get_batch`` edits the static batch buffers that full-iteration
graphs hand it, so that the second step fails before the capture; the plugin hands it copies
(``_handing_out_batch_copies``).

Importing this module imports neither megatron nor Megatron-LM; :func:`install` does.
"""

from __future__ import annotations

import argparse
import functools
import os
import runpy
import sys

from . import megatron_flags, megatron_patch

_PATCHED = "_fused_lce_patched"


def install() -> None:
    """Install the plugin and teach Megatron-LM's argument parsing ``cce`` and ``--cce-*``.

    Call it before the script's first parse (at the top of ``pretrain_gpt.py``, or let
    ``python -m fused_lce.parallel.megatron_lm`` do it). Installing twice is harmless.
    """
    try:
        from megatron.training import arguments
    except ImportError as exc:
        raise ImportError(_why_megatron_training_failed(exc)) from exc
    megatron_patch.install(options_from=options_from_megatron_lm)
    _wrap_module_function(arguments, "add_megatron_arguments", _with_cce_arguments)
    _wrap_module_function(arguments, "parse_args", _checking_cce_options)
    try:
        from megatron.core import full_cuda_graph
    except ImportError:
        full_cuda_graph = None  # megatron-core before full-iteration graphs
    if full_cuda_graph is not None and hasattr(full_cuda_graph, "StaticBufferLoader"):
        _wrap_module_function(full_cuda_graph.StaticBufferLoader, "__call__",
                              _handing_out_batch_copies)
    try:
        from megatron.training import training
    except ImportError:
        return  # a megatron.training without its loop (the tests' stand-in): no step to wrap
    _wrap_module_function(training, "train_step", _raising_found_faults)


def _why_megatron_training_failed(exc: ImportError) -> str:
    """What to do: Megatron-LM itself is missing, or one of the modules it imports is."""
    if exc.name in ("megatron", "megatron.training"):
        return ("fused_lce.parallel.megatron_lm needs Megatron-LM's megatron.training "
                "(Megatron-LM's source on PYTHONPATH, or a megatron-core wheel that ships it, "
                "0.19+)")
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return (f"Megatron-LM's megatron.training imports {exc.name!r}, which is not installed: "
                f"install it (Megatron-LM's requirements list it) ({exc})")
    return f"importing Megatron-LM's megatron.training failed: {exc}"


def options_from_megatron_lm() -> dict:
    """The op's options: the ``--cce-*`` flags of Megatron-LM's parsed global arguments, with
    the op's own CUDA graphs off under ``--cuda-graph-impl full_iteration``."""
    from megatron.training.global_vars import get_args

    args = get_args()
    options = megatron_flags.cce_options_from_args(args)
    if _full_iteration_graphs(args):
        # Megatron's graph replays the whole step, the loss included, and Python never reaches
        # the op again after the capture: graphs the op captured in the warm-up steps would only
        # hold their memory (576 MiB at TP1, hidden 2048, V 131072, on one H200;
        # docs/benchmarks/training_step.md).
        options["cuda_graphs"] = False
    megatron_flags.check_cce_options(options)
    return options


def _full_iteration_graphs(args) -> bool:
    """Whether Megatron-LM captures whole iterations: ``--cuda-graph-impl full_iteration``
    (megatron-core 0.19+), or ``--cuda-graph-impl local`` with ``full_iteration`` among the
    scopes (``--cuda-graph-scope`` in 0.16, later ``--cuda-graph-modules``)."""
    impl = getattr(args, "cuda_graph_impl", None)
    scopes = []
    for name in ("cuda_graph_scope", "cuda_graph_modules"):
        value = getattr(args, name, None)
        scopes += list(value) if isinstance(value, (list, tuple)) else [value]
    return impl == "full_iteration" or (
        impl == "local" and any(getattr(s, "name", s) == "full_iteration" for s in scopes))


def _wrap_module_function(module, name: str, wrapper_of) -> None:
    original = getattr(module, name)
    if getattr(original, _PATCHED, False):
        return
    wrapped = functools.wraps(original)(wrapper_of(original))
    setattr(wrapped, _PATCHED, True)
    setattr(module, name, wrapped)


def _with_cce_arguments(add_megatron_arguments):
    def add_megatron_and_cce_arguments(parser, *args, **kwargs):
        parser = add_megatron_arguments(parser, *args, **kwargs)
        return megatron_flags.extra_args_provider(parser)

    return add_megatron_and_cce_arguments


def _raising_found_faults(train_step):
    def train_step_after_the_faults_found(*args, **kwargs):
        from fused_lce import faults

        faults.raise_found()
        return train_step(*args, **kwargs)

    return train_step_after_the_faults_found


def _handing_out_batch_copies(load):
    """Under ``--cuda-graph-impl full_iteration`` Megatron's ``StaticBufferLoader`` hands each
    micro-batch's static buffer dict to ``get_batch``, which (megatron-core 0.19,
    ``get_batch_on_this_tp_rank``) sets the fields a pipeline stage does not use to None in that
    dict; the next step's copy into the buffer then fails ("'NoneType' object has no attribute
    'copy_'"), so pipeline parallelism never reaches the capture, whatever the loss. A shallow
    copy of the dict holds the same static tensors and leaves the buffer whole."""
    def load_into_static_buffers(*args, **kwargs):
        batch = load(*args, **kwargs)
        return dict(batch) if isinstance(batch, dict) else batch

    return load_into_static_buffers


def _checking_cce_options(parse_args):
    def parse_and_check_cce_options(*args, **kwargs):
        parsed = parse_args(*args, **kwargs)
        options = megatron_flags.cce_options_from_args(parsed)
        if options and parsed.cross_entropy_fusion_impl not in megatron_flags.CCE_CHOICES:
            raise SystemExit(
                f"{', '.join(megatron_flags.cce_flag(k) for k in options)}: these act on "
                "fused_lce's loss; use them with --cross-entropy-loss-fusion "
                "--cross-entropy-fusion-impl cce"
            )
        try:
            megatron_flags.check_cce_options(options)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        return parsed

    return parse_and_check_cce_options


def help_parser() -> argparse.ArgumentParser:
    """What ``--help`` shows: the route's usage and the flags it adds to Megatron-LM's parser."""
    parser = argparse.ArgumentParser(
        prog="python -m fused_lce.parallel.megatron_lm", usage="%(prog)s SCRIPT.py [ARGS...]",
        description="Run a Megatron-LM training script (pretrain_gpt.py, unmodified) with "
        "fused_lce's loss: Megatron-LM's parser gains the choices cce and linear for "
        "--cross-entropy-fusion-impl and the --cce-* flags below; every other argument is the "
        "script's own.",
        epilog="example: torchrun --nproc-per-node 2 -m fused_lce.parallel.megatron_lm "
        "pretrain_gpt.py --cross-entropy-loss-fusion --cross-entropy-fusion-impl cce ARGS...",
        add_help=False)
    parser.add_argument("-h", "--help", action="help", help="show this message and exit")
    return megatron_flags.extra_args_provider(parser)


def main(argv: list[str] | None = None) -> None:
    """Install, then run ``argv[0]`` as ``python SCRIPT ARGS...`` would (``__main__``)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        help_parser().print_help()
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"{help_parser().format_usage()}no such script: {script}")
    install()
    sys.argv = [script, *argv[1:]]
    # As `python SCRIPT` does: the script's folder first (pretrain_gpt.py imports its neighbours).
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
