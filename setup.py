"""Install fused_lce (the op) and lce_train (our launcher and studies around it).

The repository keeps the single-device code in ``fused_lce/`` and everything that talks to other
ranks in the top-level ``parallel/`` folder. Installed, ``parallel/`` becomes the subpackage
``fused_lce.parallel``, so users import one package for the op; nothing in it imports megatron at
import time or reaches for the training code.

``lce_train`` is a second top-level package: the megatron-core launcher, its CPU shims, the
pipeline-memory study, the gradient probes, the benchmarks' libraries and the model configs. Its
code lives in ``scripts/lce_train/`` beside the user tools of ``scripts/``, and its configs in the
top-level ``configs/`` folder, installed as the subpackage ``lce_train.configs`` with the
YAML files as package data, so a wheel finds them. ``package_dir`` does both mappings; the
package list is written out so that nothing else (tests, the scripts themselves) lands in
site-packages. Each lce_train tool is a console script (``lce-pretrain-gpt``, ...), so a wheel
user has the same commands as a checkout.
"""

from setuptools import setup

setup(
    name="fused_lce",
    version="0.1.0",
    description="Fused linear + cross-entropy for LLM training: Triton kernels, PyTorch "
    "fallbacks and a vocab-parallel layer",
    python_requires=">=3.10",
    packages=["fused_lce", "fused_lce.kernels", "fused_lce.parallel", "lce_train",
              "lce_train.configs"],
    package_dir={"fused_lce": "fused_lce", "fused_lce.parallel": "parallel",
                 "lce_train": "scripts/lce_train", "lce_train.configs": "configs"},
    package_data={"lce_train.configs": ["models/*.yaml", "experiments/*.yaml"]},
    # One command per lce_train tool, each also ``python -m lce_train.<module>``; the launcher is
    # also ``python scripts/pretrain_gpt.py`` in a checkout, under Megatron-LM's name.
    entry_points={"console_scripts": [
        "lce-pretrain-gpt = lce_train.training:main",
        "lce-compare-losses = lce_train.compare_losses:main",
        "lce-pp-memory-balance = lce_train.pp_memory_balance:main",
        "lce-build-token-file = lce_train.build_token_file:main",
        "lce-max-micro-batch = lce_train.max_micro_batch:main",
        "lce-training-equivalence = lce_train.training_equivalence:main",
        "lce-megatron-lm-report = lce_train.megatron_lm_report:main",
        "lce-plot-gpu-suite = lce_train.plot_gpu_suite:main",
        "lce-bench-parallel = lce_train.bench_parallel:main",
    ]},
    install_requires=[
        # torch's Linux CUDA wheels pin their triton: 2.8 is the first whose pin (3.4) lies in
        # the range below, so an older torch could not be installed beside it.
        "torch>=2.8",
        "numpy",
        # Triton ships Linux wheels only; elsewhere the pure-PyTorch paths are used. The range
        # is where the kernels were run: 3.6 on the GPU machines, 3.4 to 3.9 under the
        # interpreter (CI tests the pinned 3.6 and the newest, .ci/run; the interpreters of 3.4
        # and 3.5 refuse the tensor-descriptor kernels at row strides that are not a multiple of
        # 16 elements, so those ran from 3.6 on). Below 3.4 there are no tensor descriptors
        # (triton.tools.tensor_descriptor) nor tl.range's warp_specialize. Raise the upper bound
        # once the kernel tests pass on the next release.
        "triton>=3.4,<3.10; platform_system=='Linux'",
        # Model shapes (configs/*.yaml) for the launcher, benchmarks and the memory study.
        "pyyaml",
    ],
    extras_require={
        # 0.16.1 is the newest release that supports Python 3.11.
        "megatron": ["megatron-core>=0.16.1"],
        "dev": ["pytest>=8", "pytest-timeout", "ruff", "matplotlib", "pyyaml"],
        # The memory study's and the GPU reports' figures (lce-pp-memory-balance --png).
        "plot": ["matplotlib"],
        # lce-build-token-file --tokenizer bpe (the training-equivalence text corpus);
        # pinned: the same version trains the same merges.
        "data": ["tokenizers==0.23.3"],
    },
)
