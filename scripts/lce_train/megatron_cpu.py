"""Run megatron-core on the CPU over gloo: the one place where its CUDA-only calls are redirected.

megatron-core is written for GPUs. Its tensor- and pipeline-parallel machinery works over gloo on
the CPU, except for a handful of calls that name CUDA outright: ``device="cuda"`` and
``device=torch.cuda.current_device()`` allocations (collective outputs, pipeline shape tensors,
the token counter of every schedule, gradient buffers, grad-norm scratch),
``torch.cuda.synchronize`` after batched point-to-point transfers, the RNG tracker, which forks
the CUDA generator, and type checks that accept only ``'torch.cuda.FloatTensor'`` and friends
(gradient clipping, the mixed-precision and distributed optimizers' constructors).
:func:`enable_cpu_mode` redirects exactly those, so that the launcher (scripts/pretrain_gpt.py)
and the tests run the real megatron-core code paths on a CPU machine like CI's.

How: each patched module's global ``torch`` is swapped for :class:`_CpuTorch`, a stand-in that
forwards everything to ``torch`` except that tensor factories map a CUDA device to the CPU and
its ``torch.cuda`` answers ``current_device()`` with the CPU, makes ``synchronize()`` a no-op and
seeds / reads the CPU generator. Only modules listed in ``_MODULES`` are touched, each with the
reason it needs it; torch itself and every other library are left alone. The RNG tracker is
replaced by a subclass that forks the CPU generator.

Rules: nothing happens when CUDA is available; applying twice is a no-op; a module or attribute
missing from the installed megatron-core version is skipped (``applied()`` lists what was done).
Call :func:`enable_cpu_mode` before building a model; it also disables TorchDynamo (megatron's
``native`` fused cross entropy is ``torch.compile``'d: 22 s per rank on the first call on CPU,
0.13 s eager).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import types

import torch

# (module, why its CUDA calls must go to the CPU). Missing modules are skipped.
_MODULES = (
    ("megatron.core.tensor_parallel.random",
     "model_parallel_cuda_manual_seed / the RNG tracker seed and read the CUDA generator"),
    ("megatron.core.tensor_parallel.mappings",
     "all-gather / reduce-scatter outputs (SP, gather_output) are allocated on the CUDA device"),
    ("megatron.core.tensor_parallel.layers",
     "the SP all-gather buffer and GPU-initialized weights live on the CUDA device"),
    ("megatron.core.utils",
     "the global memory buffer and the local multi-tensor L2 norm allocate on CUDA"),
    ("megatron.core.transformer.utils",
     "the default causal attention mask is built with device='cuda'"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding",
     "rotary inv_freq is moved to torch.cuda.current_device() on first use"),
    ("megatron.core.pipeline_parallel.schedules",
     "every schedule (PP=1 too) allocates its token counter with device='cuda'"),
    ("megatron.core.pipeline_parallel.p2p_communication",
     "pipeline shape tensors live on CUDA and batched p2p ends with torch.cuda.synchronize()"),
    ("megatron.core.distributed.param_and_grad_buffer",
     "DDP's contiguous param/grad buffers are allocated on torch.cuda.current_device()"),
    ("megatron.core.distributed.distributed_data_parallel",
     "freeing / restoring DDP's grad buffers calls torch.cuda.synchronize() and empty_cache()"),
    ("megatron.core.optimizer.clip_grads",
     "grad-norm accumulators are created with device='cuda'"),
    ("megatron.core.optimizer.optimizer",
     "found-inf / loss-scale tensors are created with device='cuda'"),
    ("megatron.core.optimizer.distrib_optimizer",
     "the distributed optimizer's shard buffers use torch.cuda.current_device()"),
    ("megatron.core.dist_checkpointing.strategies.filesystem_async",
     "dist_checkpointing's writer calls torch.cuda.synchronize() before copying tensors out"),
    ("megatron.core.dist_checkpointing.strategies.state_dict_saver",
     "the save plan's agreement flags are allocated on the CUDA device"),
    ("megatron.core.dist_checkpointing.strategies.async_utils",
     "a synchronous save still calls torch.cuda.synchronize() and allocates on CUDA"),
    ("megatron.core.dist_checkpointing.exchange_utils",
     "shards exchanged between ranks on load are allocated on the CUDA device"),
)

# Tensor factories whose ``device=`` the stand-in maps from CUDA to the CPU.
_FACTORIES = (
    "arange", "empty", "empty_like", "full", "full_like", "ones", "ones_like", "rand",
    "randn", "randint", "tensor", "zeros", "zeros_like", "as_tensor",
)

_CPU = torch.device("cpu")
_APPLIED: list[str] = []
_ENABLED = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an int device is a GPU


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
            kwargs.pop("pin_memory", None)  # pinning needs CUDA; meaningless on the CPU
        return fn(*args, **kwargs)

    factory.__name__ = fn.__name__
    factory.__doc__ = fn.__doc__
    return factory


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as seen from a patched module: the CPU is the current device."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return _CPU

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed):
        torch.manual_seed(seed)

    @staticmethod
    def empty_cache():
        return None

    # torch.cuda.random.get_rng_state(...) in tensor_parallel/random.py
    random = types.SimpleNamespace(get_rng_state=lambda device=None: torch.get_rng_state())


class _CpuTorch(types.ModuleType):
    """``torch`` as seen from a patched module: CUDA allocations land on the CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            if hasattr(torch, name):
                setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()


def _swap_torch(module_name: str, why: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    if getattr(module, "torch", None) is torch:
        module.torch = _CPU_TORCH
        _APPLIED.append(f"{module_name}.torch -> CPU ({why})")


def _patch_rng() -> None:
    """The RNG tracker forks the CPU generator; its CUDA-state helpers read/write the CPU one."""
    try:
        random = importlib.import_module("megatron.core.tensor_parallel.random")
    except ImportError:
        return
    base = getattr(random, "CudaRNGStatesTracker", None)
    if base is None or getattr(base, "_fused_lce_cpu", False):
        return

    class CpuRNGStatesTracker(base):
        """Megatron's RNG tracker with the CPU default generator standing in for the GPU's.

        On the CPU one generator serves both roles, so ``fork`` swaps its state in and out; the
        upstream check that the CPU state is unchanged inside a fork does not apply.
        """

        _fused_lce_cpu = True

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            outside = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)

        @contextlib.contextmanager
        def fork(self, name=random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    # initialize_rng_tracker() and get_all_rng_states() read this global when called.
    random.CudaRNGStatesTracker = CpuRNGStatesTracker
    _APPLIED.append("tensor_parallel.random.CudaRNGStatesTracker -> CpuRNGStatesTracker "
                    "(fork/add swap the CPU generator's state)")
    # Checkpointed recompute saves and restores "the CUDA state": make that the CPU state.
    if hasattr(random, "_get_cuda_rng_state"):
        random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        _APPLIED.append("tensor_parallel.random._get_cuda_rng_state -> torch.get_rng_state")
    if hasattr(random, "_set_cuda_rng_state"):
        random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
        _APPLIED.append("tensor_parallel.random._set_cuda_rng_state -> torch.set_rng_state")
    # A tracker created before the patch would still be the CUDA one: drop it.
    tracker = getattr(random, "_CUDA_RNG_STATE_TRACKER", None)
    if tracker is not None and not isinstance(tracker, CpuRNGStatesTracker):
        random._CUDA_RNG_STATE_TRACKER = None
        random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False,
                                 **unused):
    """megatron's clip_grad_by_total_norm_fp32 without its ``'torch.cuda.FloatTensor'`` check."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    for grad in grads:
        if grad.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"gradient clipping expects fp32/bf16 grads, got {grad.dtype}")
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0 and grads:
        torch._foreach_mul_(grads, coeff)


def _patch_clip_grads() -> None:
    """Swap the clip function wherever megatron's optimizer modules imported it by name."""
    try:
        clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    except ImportError:
        return
    original = getattr(clip_grads, "clip_grad_by_total_norm_fp32", None)
    if original is None:
        return
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer",
                 "megatron.core.optimizer.distrib_optimizer",
                 "megatron.core.optimizer.layer_wise_optimizer"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "clip_grad_by_total_norm_fp32", None) is original:
            module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
            _APPLIED.append(f"{name}.clip_grad_by_total_norm_fp32 -> CPU version (it asserts "
                            "grads are 'torch.cuda.FloatTensor')")


@contextlib.contextmanager
def _cuda_type_names():
    """Within: ``cpu_tensor.type()`` answers ``'torch.cuda.FloatTensor'`` (etc.)."""
    original = torch.Tensor.type

    def type_name(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_name
    try:
        yield
    finally:
        torch.Tensor.type = original


@contextlib.contextmanager
def _cuda_is_cpu():
    """Within: ``tensor.cuda()`` leaves a CPU tensor where it is."""
    original = torch.Tensor.cuda

    def stay(self, *args, **kwargs):
        return self

    torch.Tensor.cuda = stay
    try:
        yield
    finally:
        torch.Tensor.cuda = original


# (module, class, method, scope to run it in, why). Each method runs inside its scope, which
# changes a torch.Tensor method for the duration of that call only (single-threaded code).
_SCOPED = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__",
     _cuda_type_names, "accepts parameters only by the names 'torch.cuda.*Tensor'"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__",
     _cuda_type_names, "accepts parameters only by the names 'torch.cuda.*Tensor'"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
     "get_parameter_state_dp_zero", _cuda_is_cpu,
     "moves each state shard to CUDA (send_tensor.cuda()) before gathering it on DP rank 0 "
     "for a fully_reshardable checkpoint"),
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "setup_embeddings_and_output_layer", _cuda_is_cpu,
     "moves the tied embedding to CUDA (weight.data.cuda()) before syncing it over PP stages"),
)


def _patch_scoped_methods() -> None:
    for module_name, class_name, method, scope, why in _SCOPED:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        original = cls.__dict__.get(method)
        if original is None or getattr(original, "_fused_lce_cpu", False):
            continue

        def wrapped(self, *args, __original=original, __scope=scope, **kwargs):
            with __scope():
                return __original(self, *args, **kwargs)

        wrapped._fused_lce_cpu = True
        wrapped.__doc__ = original.__doc__
        setattr(cls, method, wrapped)
        _APPLIED.append(f"{module_name}.{class_name}.{method} runs in {scope.__name__}() "
                        f"(it {why})")


def _disable_dynamo() -> None:
    """megatron's fused kernels are torch.compile'd: compiling costs ~22 s per rank on the CPU."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        import torch._dynamo

        torch._dynamo.config.disable = True
    except (ImportError, AttributeError):
        pass


def enable_cpu_mode() -> bool:
    """Redirect megatron-core's CUDA-only calls to the CPU (idempotent; no-op with CUDA).

    Returns:
        True when CPU mode is on after the call, False on a CUDA machine.
    """
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        return False
    _disable_dynamo()
    for module_name, why in _MODULES:
        _swap_torch(module_name, why)
    _patch_rng()
    _patch_clip_grads()
    _patch_scoped_methods()
    _ENABLED = True
    return True


def is_enabled() -> bool:
    return _ENABLED


def applied() -> list[str]:
    """What :func:`enable_cpu_mode` changed, one line per patch (for logs)."""
    return list(_APPLIED)
