"""Small draws from a seeded generator, cheaper than their ``np.random.Generator`` equivalents
for the single values the searches need once per query."""
from __future__ import annotations

import numpy as np


def draw_index(rng: np.random.Generator, count: int) -> int:
    """Uniform integer in [0, count): the floor of one uniform draw (``rng.integers`` costs ~5x more)."""
    return int(rng.random() * count)
