"""Install fused_lce (the op) and lce_train (our launcher and studies around it).

The repository keeps the single-device code in ``fused_lce/`` and everything that talks to other
ranks in the top-level ``parallel/`` folder. Installed, ``parallel/`` becomes the subpackage
``fused_lce.parallel``, so users import one package for the op; nothing in it imports megatron at
import time or reaches for the training code.

``lce_train`` is a second top-level package: the megatron-core launcher, its CPU shims, the
pipeline-memory study, the gradient probes and the model configs. Its code lives in
``scripts/lce_train/`` beside the thin command lines over it (``scripts/*.py``), and its configs
in the top-level ``configs/`` folder, installed as the subpackage ``lce_train.configs`` with the
YAML files as package data, so a wheel finds them. ``package_dir`` does both mappings; the
package list is written out so that nothing else (tests, the scripts themselves) lands in
site-packages. Each lce_train tool is also a console script (``lce-pretrain-gpt``, ...), so a
wheel user has the same commands as a checkout's ``scripts/*.py``.
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
    # One command per lce_train tool, each also ``python -m lce_train.<module>`` and, in a
    # checkout, ``python scripts/<name>.py``.
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
        "torch>=2.4",
        "numpy",
        # Triton ships Linux wheels only; elsewhere the pure-PyTorch paths are used.
        "triton; platform_system=='Linux'",
        # Model shapes (configs/*.yaml) for the launcher, benchmarks and the memory study.
        "pyyaml",
    ],
    extras_require={
        # 0.16.1 is the newest release that supports Python 3.11.
        "megatron": ["megatron-core>=0.16.1"],
        "dev": ["pytest>=8", "pytest-timeout", "ruff", "matplotlib", "pyyaml"],
        # The memory study's and the GPU reports' figures (lce-pp-memory-balance --png).
        "plot": ["matplotlib"],
        # scripts/build_token_file.py --tokenizer bpe (the training-equivalence text corpus);
        # pinned: the same version trains the same merges.
        "data": ["tokenizers==0.23.3"],
    },
)
