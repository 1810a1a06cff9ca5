"""How far a triggering input is from its seed, and constraints that keep the search close to it.

A deviation found by turning a digit into noise says little about the compressed model; one found
by a change a person barely sees says a lot. Every trigger is measured against its seed:

- ``l0``: pixels changed (a pixel counts once, whatever its channels), and ``l0_fraction`` of all pixels;
- ``l2``: Euclidean distance of the images scaled to [0, 1] (pixel / 255);
- ``linf``: the largest change of one channel value, in 8-bit levels (0-255);
- ``ssim``: structural similarity (Wang et al., IEEE TIP 2004) with the paper's settings: an
  11x11 Gaussian window of sigma 1.5, K1 = 0.01, K2 = 0.03, data range 255, averaged over the
  positions where the window fits and over the channels (scikit-image's
  ``structural_similarity(..., gaussian_weights=True, use_sample_covariance=False)``);
- ``ssim_whole``: the same local SSIMs averaged over windows centred on every pixel, the images
  mirrored at their edges (scikit-image's map before it crops the border).

:class:`Constraint` (``--max-linf``, ``--min-ssim``) is checked on every mutant before it is
queried: a mutant outside it is rejected without a query (see :class:`~mlflow_di.fuzz.dflare.DFlareSearch`).
``--min-ssim`` bounds both SSIMs (:func:`budget_ssims`). The paper's measure barely weighs the
image's outer 5 pixels (a corner pixel sits in one window, at weight 1e-5), and a search held to it
alone puts its noise there: DFlare under SSIM >= 0.9 on the DFlare LeNet-5 pair, MNIST test
[9000:9100], found 51 triggers, all with a whole-image SSIM below 0.9 (median 0.54; a median 62% of
the change on those outer pixels); under both SSIMs it finds 6 (benchmarks/RESULTS.md,
bench_boundary). The whole-image measure alone would be the looser one for a change inside the
image (its unchanged border windows count as 1), so the budget takes the lower of the two.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from scipy.ndimage import correlate1d

from mlflow_di.errors import UserError

SSIM_SIGMA = 1.5
#: the window spans +-5 pixels (11x11), as in Wang et al. and scikit-image (truncate 3.5 sigma)
SSIM_RADIUS = 5
SSIM_K1, SSIM_K2, SSIM_RANGE = 0.01, 0.03, 255.0


#: the 1-D Gaussian window (scipy's gaussian_filter1d kernel for sigma 1.5, truncate 5/1.5), made once;
#: the differentiable SSIM and the pixel costs take it too
SSIM_WINDOW = np.exp(-0.5 / SSIM_SIGMA ** 2 * np.arange(-SSIM_RADIUS, SSIM_RADIUS + 1) ** 2)
SSIM_WINDOW = SSIM_WINDOW / SSIM_WINDOW.sum()


def _filter(values: np.ndarray, first: int = 0) -> np.ndarray:
    """Gaussian-weighted local means over H and W (axes ``first`` and ``first + 1``) at every pixel,
    the values mirrored at their edges (scipy's "reflect": the edge pixel repeated)."""
    for axis in (first, first + 1):
        values = correlate1d(values, SSIM_WINDOW, axis=axis, mode="reflect")
    return values


def ssim(image: np.ndarray, reference: np.ndarray, whole: bool = False) -> float:
    """Mean structural similarity of two uint8 (H, W, C) images (1.0 when equal): the paper's
    measure, or (``whole``) the average over windows centred on every pixel (module docstring)."""
    return float(ssims(np.asarray(image)[None], reference, whole)[0])


def budget_ssim(image: np.ndarray, reference: np.ndarray) -> float:
    """What ``--min-ssim`` bounds: the lower of the paper's SSIM and the whole-image SSIM (one pass)."""
    return float(budget_ssims(np.asarray(image)[None], reference)[0])


def ssims(images: np.ndarray, reference: np.ndarray, whole: bool = False) -> np.ndarray:
    """:func:`ssim` of each uint8 (N, H, W, C) image to one (H, W, C) reference, in one pass (the
    same values: every window is filtered alone)."""
    return _mean_ssims(_ssim_maps(*_checked(images, reference)), whole)


def budget_ssims(images: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """:func:`budget_ssim` of each uint8 (N, H, W, C) image to one (H, W, C) reference, in one pass."""
    maps = _ssim_maps(*_checked(images, reference))
    return np.minimum(_mean_ssims(maps, False), _mean_ssims(maps, True))


def _checked(images: np.ndarray, reference: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both as float64, or one clear line when they are not (N, H, W, C) images of the reference's
    (H, W, C) shape, at least as large as the window."""
    a = np.asarray(images, np.float64)
    b = np.asarray(reference, np.float64)
    if a.shape[1:] != b.shape or b.ndim != 3:
        raise UserError(f"SSIM needs images of one (H, W, C) shape, got {a.shape[1:]} and {b.shape}")
    if min(b.shape[:2]) <= 2 * SSIM_RADIUS:
        raise UserError(f"SSIM needs images of at least {2 * SSIM_RADIUS + 1}x{2 * SSIM_RADIUS + 1} pixels, "
                        f"got {b.shape[0]}x{b.shape[1]}")
    return a, b


def _mean_ssims(maps: np.ndarray, whole: bool) -> np.ndarray:
    """Each image's mean over its (N, H, W, C) SSIM map: every window, or (the paper) those that fit."""
    if not whole:
        maps = maps[:, SSIM_RADIUS:-SSIM_RADIUS, SSIM_RADIUS:-SSIM_RADIUS]
    return maps.reshape(len(maps), -1).mean(axis=1)


def _ssim_maps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """SSIM at windows centred on every pixel of each float (N, H, W, C) image ``a`` against one
    (H, W, C) reference, the images mirrored at their edges (the paper's windows are the inner ones):
    the image's three local moments filtered in one pass, the reference's two taken from
    :func:`_reference_moments` (a search checks SSIM to one seed on every mutant it makes)."""
    mean_b, mean_bb = _reference_moments(b)
    moments = _filter(np.stack([a, a * a, a * b], axis=-1), 1)
    mean_a, mean_aa, mean_ab = np.moveaxis(moments, -1, 0)
    return ssim_from_moments(mean_a, mean_b, mean_aa, mean_bb, mean_ab)


#: the last reference's local mean and mean square, with what they were computed from
_REFERENCE: tuple = (None, None, None)


def _reference_moments(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    global _REFERENCE
    key = (b.shape, b.tobytes())
    cached = _REFERENCE  # read once: another thread may replace it, never half of it
    if cached[0] != key:
        moments = _filter(np.stack([b, b * b], axis=-1), 0)
        cached = _REFERENCE = (key, moments[..., 0], moments[..., 1])
    return cached[1], cached[2]


def local_ssim(a, b, local_mean):
    """SSIM at every window position of ``a`` against ``b``, given ``local_mean`` (Gaussian-weighted
    means at the caller's window positions): plain arithmetic, so numpy arrays and torch tensors (with their
    gradients, :func:`~mlflow_di.fuzz.boundary.differentiable_ssim`) share it."""
    return ssim_from_moments(local_mean(a), local_mean(b), local_mean(a * a), local_mean(b * b), local_mean(a * b))


def ssim_from_moments(mean_a, mean_b, mean_aa, mean_bb, mean_ab):
    """SSIM at every window position from the local means of a, b, a*a, b*b and a*b."""
    var_a = mean_aa - mean_a ** 2
    var_b = mean_bb - mean_b ** 2
    cov = mean_ab - mean_a * mean_b
    c1, c2 = (SSIM_K1 * SSIM_RANGE) ** 2, (SSIM_K2 * SSIM_RANGE) ** 2
    return ((2 * mean_a * mean_b + c1) * (2 * cov + c2)) / ((mean_a ** 2 + mean_b ** 2 + c1) * (var_a + var_b + c2))


def ssim_pixel_cost(seed: np.ndarray) -> np.ndarray:
    """What changing each pixel of ``seed`` costs in SSIM: (H, W, C) weights w such that a change of
    d levels at one pixel lowers the sum of the local SSIMs by about w * d**2 (second order, exact
    as d -> 0; the derivation is in the comment below).

    Unlike :func:`ssim`, whose windows only sit where they fit, the sum runs over windows centred on
    every pixel of the seed reflected outward by the window's width, so a pixel near the border
    costs what the same pixel would cost inside the image. The metric barely sees a 5-pixel frame
    (the corner pixel is in one window, at weight 1e-5); a search steered by the metric's own costs
    paints that frame white at SSIM 0.98-0.99 (measured on MNIST test [9700:9740], LeNet-5 pair: a
    median 95% of each trigger's change in the frame), which no person would call realistic."""
    import torch
    import torch.nn.functional as F

    k = torch.from_numpy(SSIM_WINDOW)
    kernel = torch.outer(k, k)[None, None]
    pad = 2 * SSIM_RADIUS
    y = torch.from_numpy(np.asarray(seed, np.float64)).permute(2, 0, 1)[:, None]  # (C, 1, H, W)
    y = F.pad(y, (pad, pad, pad, pad), mode="reflect")
    mean = F.conv2d(y, kernel)
    var = F.conv2d(y * y, kernel) - mean ** 2
    c1, c2 = (SSIM_K1 * SSIM_RANGE) ** 2, (SSIM_K2 * SSIM_RANGE) ** 2
    # 1 - luminance ~ (k d)^2 / (2 mean^2 + c1); 1 - contrast-structure ~ k (1 - k) d^2 / (2 var + c2):
    # each window's share, spread back onto the pixels it weighs (the adjoint of the windowed mean)
    cost = (F.conv_transpose2d(1 / (2 * var + c2), kernel - kernel ** 2)
            + F.conv_transpose2d(1 / (2 * mean ** 2 + c1), kernel ** 2))
    return cost[:, 0, pad:-pad, pad:-pad].permute(1, 2, 0).numpy()


def distances(image: np.ndarray, seed: np.ndarray) -> dict[str, float]:
    """``l0``, ``l0_fraction``, ``l2``, ``linf`` and ``ssim`` of ``image`` from ``seed`` (module docstring)."""
    difference = np.asarray(image, np.int16) - np.asarray(seed, np.int16)
    changed = np.any(difference != 0, axis=-1)
    values = {"l0": int(changed.sum()), "l0_fraction": float(changed.mean()),
              "l2": float(np.sqrt(np.sum((difference / 255.0) ** 2))),
              "linf": int(np.abs(difference).max()) if difference.size else 0}
    values["ssim"] = values["ssim_whole"] = None
    if min(np.shape(seed)[:2]) > 2 * SSIM_RADIUS:
        maps = _ssim_maps(*_checked(np.asarray(image)[None], seed))
        values["ssim"], values["ssim_whole"] = (float(_mean_ssims(maps, whole)[0]) for whole in (False, True))
    return values


@dataclasses.dataclass(frozen=True)
class Constraint:
    """Where a mutant may go: at most ``max_linf`` 8-bit levels from its seed in any value, and an
    SSIM to its seed of at least ``min_ssim``, both the paper's and the whole-image SSIM
    (:func:`budget_ssim`). ``None`` leaves a bound off."""

    max_linf: int | None = None
    min_ssim: float | None = None

    def __post_init__(self):
        if self.max_linf is not None and not 1 <= self.max_linf <= 255:
            raise UserError(f"max_linf is in 8-bit levels and must be 1-255, got {self.max_linf}")
        if self.min_ssim is not None and not -1.0 < self.min_ssim < 1.0:
            raise UserError(f"min_ssim must lie between -1 and 1 (1 would allow no change), got {self.min_ssim}")

    @property
    def active(self) -> bool:
        return self.max_linf is not None or self.min_ssim is not None

    def check_seed(self, seed: np.ndarray) -> None:
        """A UserError when ``min_ssim`` is asked for on images too small for SSIM's window."""
        if self.min_ssim is not None and min(np.shape(seed)[:2]) <= 2 * SSIM_RADIUS:
            raise UserError(f"--min-ssim needs images of at least {2 * SSIM_RADIUS + 1}x{2 * SSIM_RADIUS + 1} "
                            f"pixels, got {np.shape(seed)[0]}x{np.shape(seed)[1]}; use --max-linf")

    def allows(self, image: np.ndarray, seed: np.ndarray) -> bool:
        """Whether ``image`` is within the constraint around ``seed``."""
        return bool(self.allows_each(np.asarray(image)[None], seed)[0])

    def allows_each(self, images: np.ndarray, seed: np.ndarray) -> np.ndarray:
        """:meth:`allows` for each of the (N, H, W, C) ``images``: the cheap L-inf test first, then
        SSIM in one pass over the images that passed it."""
        images = np.asarray(images)
        inside = np.ones(len(images), bool)
        if self.max_linf is not None:
            inside = np.abs(images.astype(np.int16) - seed).reshape(len(images), -1).max(axis=1) <= self.max_linf
        if self.min_ssim is not None and inside.any():
            inside[inside] = budget_ssims(images[inside], seed) >= self.min_ssim
        return inside

    def met_by(self, distances: dict | None) -> bool:
        """Whether a trigger with these :func:`distances` meets every bound that can be measured on it
        (SSIM is not defined on images smaller than its window: then L-inf alone). :meth:`allows`
        decides the same from the images, before a query; this, from a record, after. A record saved
        before ``ssim_whole`` was measured is judged by the paper's SSIM alone."""
        if not distances:
            return False
        if self.max_linf is not None and distances["linf"] > self.max_linf:
            return False
        return self.min_ssim is None or all(distances.get(key) is None or distances[key] >= self.min_ssim
                                            for key in ("ssim", "ssim_whole"))

    def at_least_as_strict_as(self, other: "Constraint", ssim_measurable: bool = True) -> bool:
        """Whether every image this budget allows, ``other`` allows too: each bound ``other`` sets is set here
        at least as tightly (its SSIM bound only where SSIM is ``ssim_measurable``, on images of at least
        the window's size: elsewhere neither budget can hold an image to it)."""
        if other.max_linf is not None and (self.max_linf is None or self.max_linf > other.max_linf):
            return False
        if other.min_ssim is not None and ssim_measurable and (self.min_ssim is None or self.min_ssim < other.min_ssim):
            return False
        return True

    def options_text(self, ssim_measurable: bool = True) -> str:
        """The ``fuzz`` options that search inside this budget, e.g. ``--max-linf 32 --min-ssim 0.9``."""
        options = [f"--max-linf {self.max_linf}"] if self.max_linf is not None else []
        if self.min_ssim is not None and ssim_measurable:
            options.append(f"--min-ssim {self.min_ssim:g}")
        return " ".join(options)

    @classmethod
    def parse(cls, text: str) -> "Constraint":
        """``linf=32,ssim=0.9`` (either or both) as a Constraint; a one-line UserError otherwise."""
        names = {"linf": "max_linf", "ssim": "min_ssim"}
        bounds: dict = {}
        for part in filter(None, (piece.strip() for piece in str(text).split(","))):
            key, _, value = part.partition("=")
            if key.strip() not in names or not value.strip():
                raise UserError(f"a realism budget is linf=LEVELS and/or ssim=VALUE, e.g. linf=32,ssim=0.9; got '{text}'")
            try:
                bounds[names[key.strip()]] = int(value) if key.strip() == "linf" else float(value)
            except ValueError:
                raise UserError(f"{key.strip()} in a realism budget must be a number, got '{value.strip()}'") from None
        if not bounds:
            raise UserError(f"a realism budget needs linf=LEVELS and/or ssim=VALUE, e.g. linf=32,ssim=0.9; got '{text}'")
        return cls(**bounds)

    def describe(self) -> str:
        """The bounds in words, e.g. ``L-inf <= 32, paper's and whole-image SSIM >= 0.9 where measurable``."""
        bounds = [f"L-inf <= {self.max_linf}"] if self.max_linf is not None else []
        if self.min_ssim is not None:
            bounds.append(f"paper's and whole-image SSIM >= {self.min_ssim:g} where measurable")
        return ", ".join(bounds) or "no bound"

    def to_dict(self) -> dict:
        return {"max_linf": self.max_linf, "min_ssim": self.min_ssim}

    def options(self) -> dict:
        """What a strategy's campaign records of this budget (``resume`` compares it): the bounds, and
        under ``min_ssim`` which SSIMs it bounds, so a campaign saved when ``--min-ssim`` bounded the
        paper's SSIM alone refuses to resume under the stricter budget. Empty when no bound is set."""
        if not self.active:
            return {}
        return {"constraint": self.to_dict(), **({"ssim_bound": SSIM_BOUND} if self.min_ssim is not None else {})}


#: which SSIMs ``min_ssim`` bounds, as campaigns record it
SSIM_BOUND = "paper and whole image"


#: What a trigger must meet to count as realistic when a campaign set no budget of its own: SSIM of at
#: least 0.9 to its seed (where the image is large enough for SSIM's window) and no value moved by
#: more than 32 of 256 levels. Looser triggers are reported too, but as what they are: noise-like.
DEFAULT_BUDGET = Constraint(max_linf=32, min_ssim=0.9)


def parse_budget(text: str) -> Constraint:
    """:meth:`Constraint.parse` (what ``gate --realism-budget`` takes)."""
    return Constraint.parse(text)


def mostly_noise(realistic: int, triggers: int) -> bool:
    """Whether fewer than half of a campaign's ``triggers`` are within its realism budget: its success
    rate and queries then count noise-like inputs, and every place that shows them says so."""
    return realistic * 2 < triggers


def campaign_budget(constraint: Constraint | None) -> Constraint:
    """The budget a campaign's triggers are judged by: the one it searched inside (``--max-linf``,
    ``--min-ssim``: the bounds it set, no others), else :data:`DEFAULT_BUDGET`."""
    return constraint if constraint is not None and constraint.active else DEFAULT_BUDGET


def realism_summary(records, fuzzed: int, budget: Constraint = DEFAULT_BUDGET) -> dict:
    """``realistic_triggers`` (triggers within ``budget``), ``realistic_success_rate`` (those over the
    seeds fuzzed: the success rate a person would believe) and the budget's bounds as
    ``realism_max_linf`` / ``realism_min_ssim``."""
    realistic = sum(budget.met_by(r.trigger_distances) for r in records if r.success)
    return {"realistic_triggers": realistic, "realistic_success_rate": realistic / fuzzed if fuzzed else 0.0,
            "realism_max_linf": budget.max_linf, "realism_min_ssim": budget.min_ssim}


def distribution_rows(records) -> list[dict]:
    """Per distance (l0, l2, linf, ssim): how many triggers have it, and its minimum, quartiles and
    maximum over the campaign's triggers (the report's realism table: distributions, not only medians)."""
    rows = distance_rows(records)
    table = []
    for key in ("ssim", "ssim_whole", "linf", "l2", "l0"):
        values = np.asarray([row[key] for row in rows if row.get(key) is not None], np.float64)
        if len(values):
            low, q1, median, q3, high = np.percentile(values, [0, 25, 50, 75, 100])
            table.append({"distance": key, "triggers": int(len(values)), "min": float(low), "p25": float(q1),
                          "median": float(median), "p75": float(q3), "max": float(high)})
    return table


def distance_rows(records) -> list[dict]:
    """One row per trigger: seed index and its distances (records without distances are left out)."""
    return [{"seed": r.index, **r.trigger_distances} for r in records if r.success and r.trigger_distances]


def distance_summary(records) -> dict[str, float]:
    """Median and maximum of each distance over a campaign's triggers (metrics such as ``trigger_linf_median``)."""
    rows = distance_rows(records)
    summary = {}
    for key in ("l0", "l2", "linf", "ssim", "ssim_whole"):
        values = [row[key] for row in rows if row.get(key) is not None]
        if values:
            summary[f"trigger_{key}_median"] = float(np.median(values))
            worst, name = (min, "min") if key.startswith("ssim") else (max, "max")  # SSIM: lower is worse
            summary[f"trigger_{key}_{name}"] = float(worst(values))
    return summary
