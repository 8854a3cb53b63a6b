"""Fresh random state: a restored process would otherwise repeat its snapshot's numbers."""

from __future__ import annotations

import os
import random
import sys


def reseed_generators() -> list[str]:
    """Reseed Python's `random`, and NumPy's and torch's global generators if imported."""
    reseeded = ["random"]
    random.seed(os.urandom(32))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
        reseeded.append("numpy")
    torch = sys.modules.get("torch")
    if torch is not None:
        seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
        torch.manual_seed(seed)  # seeds every device's default generator too
        reseeded.append("torch")
    return reseeded
