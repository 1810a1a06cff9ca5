"""What ``mlflow-di compress`` asks of every method beyond compressing everything (:class:`Selection`: layers
kept in float, the diagnosis, the bounded search and its data, each method's own settings, the runtimes scored on), the
bounded search's held-out images with the source's answers (:class:`HeldOut`), and the source's
probabilities both are measured against.

Frozen values: the command builds one Selection for every method. Models and images in, values out; no MLflow.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

from mlflow_di.models.runtimes import RuntimeChoice

if TYPE_CHECKING:
    import numpy as np

    from mlflow_di.compression.bounded import Bounds, LabelledSplit
    from mlflow_di.data import ImageSet
    from mlflow_di.models.torch_model import TorchModel


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """The bounded search's held-out images (prepared), the source's probabilities on them, and the
    :class:`~mlflow_di.compression.bounded.LabelledSplit` the search verifies its choice on."""

    images: ImageSet
    probabilities: np.ndarray
    split: LabelledSplit

    @classmethod
    def measure(cls, source: TorchModel, images: ImageSet, device) -> HeldOut:
        """``images`` (prepared) with the source's answers on them, measured on ``device``."""
        probabilities = source_probabilities(source, images, device)
        return cls(images, probabilities, labelled_split(images, probabilities))

    def require_provable(self, bounds: Bounds, fuzz_seeds: int) -> None:
        """A UserError when these images could not prove a bound even for an export that never differs from its
        source (the 95% interval of a perfect result reaches beyond the bound): said before any export is made."""
        import numpy as np

        from mlflow_di.errors import UserError

        images = len(self.split.labels)
        right = int(np.sum(np.asarray(self.split.original) == np.asarray(self.split.labels)))
        refused = bounds.unprovable(images, right, min(fuzz_seeds, images))
        if refused:
            raise UserError(f"the held-out data {self.images.name} is too small: " + "; ".join(refused)
                            + " (give a larger --holdout-data, or loosen the bound)")


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a selective method does beyond compressing everything, the same for every method of a command:
    layers kept in float (named, or the worst ``auto_keep_float`` by the diagnosis), the layer-wise
    diagnosis and its data, the bounded search and its data, the sensitivity split, each method's own settings
    (int8-static's: its recipe), and whether each export's benefit is measured."""

    keep_float: tuple[str, ...] = ()
    auto_keep_float: int = 0
    diagnosis_images: int = 256
    trigger_images: np.ndarray | None = None  # the --triggers campaign's triggers (uint8 NHWC), diagnosed and blamed
    triggers_folder: str | None = None  # that campaign's folder
    graph: str | None = None  # an ONNX original's file: quantization starts from it, not from its view
    bounds: Bounds | None = None  # search for the fewest float layers meeting them
    sensitivity: bool = False  # the per-layer sensitivity split (compression.sensitivity)
    fuzz_seeds: int = 50  # seeds per split fuzzed against each candidate for a realistic-success bound
    splits: tuple[LabelledSplit, LabelledSplit | None] | tuple[()] = ()  # (evaluation, held-out): search, sensitivity
    settings: Mapping[str, object] = dataclasses.field(default_factory=dict)  # method -> its own settings object
    semantics: str = "host"  # which answers a bound judges: host, reference or both
    benefit: bool = True  # measure latency, size and memory of each export and its source
    held_out: HeldOut | None = None  # a bounded search's held-out data: the figures the gate judges
    runtimes: tuple[RuntimeChoice, ...] = ()  # what each export is scored on (empty: the default runtime alone)

    def scored_also_on(self, made_for: str | None) -> Selection:
        """This selection with the runtime a method's exports are made for after the runtimes asked for (as is
        when there is none, it is asked already, or it is not installed)."""
        if made_for is None:
            return self
        choice = RuntimeChoice.parse(made_for)
        asked = self.runtimes or (self.primary_runtime,)
        if choice.label in {c.label for c in asked} or choice.runtime.missing():
            return self
        return dataclasses.replace(self, runtimes=(*asked, choice))

    def settings_of(self, method: str):
        """``method``'s own settings object (:meth:`~mlflow_di.compression.declarations.MethodDeclaration.configure`):
        the one the command configured from its options, else its options' defaults."""
        from mlflow_di.compression.declarations import method_declaration

        chosen = self.settings.get(method)
        return chosen if chosen is not None else method_declaration(method).configure()

    @property
    def primary_runtime(self) -> RuntimeChoice:
        """The runtime whose answers are the export's own figures (the first asked for)."""
        return self.runtimes[0] if self.runtimes else RuntimeChoice()

    @property
    def selective(self) -> bool:
        """Whether layers are kept in float by name or by the diagnosis (not by a bounded search)."""
        return bool(self.keep_float or self.auto_keep_float)


def source_probabilities(source: TorchModel, images: ImageSet | None, device) -> np.ndarray | None:
    """The source model's probabilities on ``images`` (None without images), computed on ``device``."""
    from mlflow_di.models.device import resolve_device

    if images is None:
        return None
    try:  # the source goes back to the CPU afterwards: the next method exports and prunes it there
        return source.to(resolve_device(device)).classifier().predict_proba(images.images)
    finally:
        source.to("cpu")


def labelled_split(images: ImageSet, probabilities: np.ndarray) -> LabelledSplit:
    """A :class:`~mlflow_di.compression.bounded.LabelledSplit` of prepared images and the source's probabilities."""
    from mlflow_di.compression.bounded import LabelledSplit

    return LabelledSplit(images.name, images.images, images.labels, probabilities.argmax(axis=1))
