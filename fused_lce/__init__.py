"""fused_lce: linear + cross-entropy without the logits (Cut Cross-Entropy), one device or many.

    loss = fused_lce.linear_cross_entropy(hidden, weight, target)

The vocab-parallel layer lives in ``fused_lce.parallel``.
"""

from .api import LinearCrossEntropy, linear_cross_entropy
from .faults import raise_deferred_errors
from .options import LCEOptions

__all__ = ["LCEOptions", "LinearCrossEntropy", "linear_cross_entropy", "raise_deferred_errors"]
__version__ = "0.1.0"
