"""Install fused_lce.

The repository keeps the single-device code in ``fused_lce/`` and everything that talks to other
ranks in the top-level ``parallel/`` folder. Installed, ``parallel/`` becomes the subpackage
``fused_lce.parallel``, so users import one package. ``package_dir`` does that mapping; the
package list is written out so that nothing else (tests, scripts) lands in site-packages.
"""

from setuptools import setup

setup(
    name="fused_lce",
    version="0.1.0",
    description="Fused linear + cross-entropy for LLM training: Triton kernels, PyTorch "
    "fallbacks and a vocab-parallel layer",
    python_requires=">=3.10",
    packages=["fused_lce", "fused_lce.kernels", "fused_lce.parallel"],
    package_dir={"fused_lce": "fused_lce", "fused_lce.parallel": "parallel"},
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
        # scripts/build_token_file.py --tokenizer bpe (the training-equivalence text corpus);
        # pinned: the same version trains the same merges.
        "data": ["tokenizers==0.23.3"],
    },
)
