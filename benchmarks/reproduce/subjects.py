"""The models and data the experiments run on, loaded once per process and shared.

Full/quick modes: the three DeepImportance LeNets (Keras HDF5 ported by ``import_keras``) and
MNIST from ../shared; the DFlare LeNets ('same' padding) with their TFLite versions and the
package's own ``int8-static`` / ``prune-l1`` ONNX exports of the DFlare LeNet-5. Tiny mode: the
demo's digits CNN trained for a few epochs on scikit-learn's 8x8 digits, and its own exports.

Fitted coverage models are cached by (model, settings) so experiments that need the same IDC or
criteria fit (RQ2, RQ3, RQ5) do not repeat it.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pathlib

import mlflow_di  # noqa: F401  (torchvision guard before zennit/torchvision are imported)
import numpy as np
import torch

from mlflow_di.data import ImageSet, load_images
from mlflow_di.errors import UserError
from mlflow_di.coverage.criteria import ClassicCoverage
from mlflow_di.coverage.idc import ImportanceDrivenCoverage
from mlflow_di.models.classifier import Classifier, OnnxClassifier
from mlflow_di.models.keras_import import import_keras
from mlflow_di.models.loading import load_classifier
from mlflow_di.models.torch_model import TorchModel

from benchmarks.reproduce.config import Config
from benchmarks.reproduce.perturb import relevant_pixel_mask

DEEPIMPORTANCE_ARCH = {"LeNet1": "lenet1", "LeNet4": "lenet4", "LeNet5": "lenet5"}
TINY_TRAIN_EPOCHS = 15
PAIR_DESCRIPTIONS = {
    "lenet1-tflite": "DFlare LeNet-1 (Keras lenet1.h5, ported to PyTorch) vs lenet1-quan.lite (TFLite 8-bit)",
    "lenet5-tflite": "DFlare LeNet-5 (Keras lenet5.h5, ported to PyTorch) vs lenet5-quan.lite (TFLite 8-bit)",
    "lenet5-int8-static": "DFlare LeNet-5 (PyTorch) vs its mlflow-di `int8-static` ONNX export "
                          "(calibrated on the first {calibration} MNIST test images)",
    "lenet5-prune-l1": "DFlare LeNet-5 (PyTorch) vs its mlflow-di `prune-l1` ONNX export "
                       "({prune:.0%} of the weights, global L1)",
    "digits-int8-static": "digits CNN (PyTorch) vs its mlflow-di `int8-static` ONNX export",
    "digits-prune-l1": "digits CNN (PyTorch) vs its mlflow-di `prune-l1` ONNX export",
}


def pair_description(name: str, config: Config) -> str:
    """What a Table 4 pair is, without loading it."""
    return PAIR_DESCRIPTIONS.get(name, name).format(calibration=config.calibration_size, prune=config.prune_amount)


@dataclasses.dataclass
class Pair:
    """An original model and its compressed version, both black boxes, for DFlare Table 4."""

    name: str
    original: Classifier
    compressed: Classifier
    description: str


class Subjects:
    """Lazily loaded models, data and fitted coverage models for one :class:`Config`."""

    def __init__(self, config: Config, work_dir: pathlib.Path):
        self.config = config
        self.work_dir = pathlib.Path(work_dir)
        os.environ["MLFLOW_DI_THREADS"] = str(config.threads)  # read by the ONNX/TFLite backends
        torch.set_num_threads(config.threads)
        self.tiny = config.mode == "tiny"
        if not self.tiny:
            self._check_shared()

    def _check_shared(self) -> None:
        shared = pathlib.Path(self.config.shared)
        if not (shared / "models").is_dir() or not self.config.mnist_dir.is_dir():
            raise UserError(f"reference models and MNIST not found in {shared}; set MLFLOW_DI_SHARED or use --tiny")

    # ------------------------------------------------------------------------------ data
    @functools.cached_property
    def _digits(self) -> ImageSet:
        return load_images("digits")

    @functools.cached_property
    def analysis(self) -> ImageSet:
        """The analysis ("training") set: importance analysis, clustering, criteria bounds."""
        if self.tiny:
            return self._digits.subset(slice(0, self.config.analysis_size), f"digits[0:{self.config.analysis_size}]")
        return load_images(self.config.analysis_spec)

    @functools.cached_property
    def test(self) -> ImageSet:
        """The test set U_O."""
        if self.tiny:
            n = len(self._digits)
            return self._digits.subset(slice(n - self.config.test_size, n), f"digits[{n - self.config.test_size}:{n}]")
        return load_images(self.config.test_spec)

    @functools.cached_property
    def fuzz_seeds(self) -> ImageSet:
        """DFlare's seed inputs (the paper: 500 test images)."""
        return self._first_images(self.config.fuzz_seeds)

    @functools.cached_property
    def dissemination_seeds(self) -> ImageSet:
        return self._first_images(self.config.rq4_seeds)

    def _first_images(self, n: int) -> ImageSet:
        if self.tiny:
            return self._digits.subset(slice(0, n), f"digits[0:{n}]")
        return load_images(f"mnist:{self.config.mnist_dir}[0:{n}]")

    # ---------------------------------------------------------------------------- models
    @functools.cached_property
    def idc_models(self) -> dict[str, TorchModel]:
        """The IDC paper's subject models by name (tiny: the trained digits CNN)."""
        if self.tiny:
            return {"DigitsCNN": self.tiny_model}
        folder = pathlib.Path(self.config.shared) / "models" / "deepimportance"
        return {name: _named(import_keras(DEEPIMPORTANCE_ARCH[name], folder / f"{name}.h5"), name)
                for name in self.config.idc_models}

    @functools.cached_property
    def tiny_model(self) -> TorchModel:
        """The demo's digits CNN trained for a few epochs on the tiny analysis set (seeded)."""
        from mlflow_di.models import zoo
        from mlflow_di.models.training import train_classifier

        spec = zoo.architecture("digits-cnn")
        module = zoo.build("digits-cnn", seed=0)
        train_classifier(module, spec.preprocessing.apply(self.analysis.images), self.analysis.labels,
                         epochs=TINY_TRAIN_EPOCHS, seed=0, progress=False)
        return TorchModel(module, spec.preprocessing, name="DigitsCNN")

    @functools.cached_property
    def dflare_original(self) -> TorchModel:
        """The DFlare LeNet-5 ('same' padding), source of the own compressions and of RQ4's mutants."""
        if self.tiny:
            return self.tiny_model
        path = pathlib.Path(self.config.shared) / "models" / "dflare" / "lenet5.h5"
        return _named(import_keras("lenet5-same", path), "DFlare-LeNet5")

    def pair(self, name: str) -> Pair:
        """One DFlare Table 4 pair by name (see :data:`benchmarks.reproduce.config.PAIRS`)."""
        dflare = pathlib.Path(self.config.shared) / "models" / "dflare"
        if name in ("lenet1-tflite", "lenet5-tflite"):
            arch = name.split("-")[0]
            original = load_classifier(f"keras:{arch}-same:{dflare / f'{arch}.h5'}")
            compressed = load_classifier(str(dflare / f"{arch}-quan.lite"))
            return Pair(name, original, compressed, pair_description(name, self.config))
        for method in ("int8-static", "prune-l1"):
            if name.endswith(method):
                source = self.dflare_original
                return Pair(name, source.classifier(), self.own_compression(method), pair_description(name, self.config))
        raise UserError(f"unknown pair '{name}'")

    @functools.lru_cache(maxsize=None)
    def own_compression(self, method: str) -> OnnxClassifier:
        """The package's own compression of :attr:`dflare_original` (int8-static calibrated on the first images)."""
        from mlflow_di.compression import compress

        source = self.dflare_original
        calibration = self._first_images(self.config.calibration_size).images if method == "int8-static" else None
        result = compress(source.module, source.preprocessing, method, self.work_dir / "compressed" / source.name,
                          calib_inputs=calibration, amount=self.config.prune_amount)
        return OnnxClassifier(result.path, name=f"{source.name}-{method}.onnx")

    # ------------------------------------------------------------------- fitted coverage
    @functools.lru_cache(maxsize=None)
    def idc(self, model_name: str, top_m: int, seed: int) -> ImportanceDrivenCoverage:
        """IDC fitted on the analysis set (default subject layer, epsilon-LRP, k in {2,3,4})."""
        return ImportanceDrivenCoverage(top_m=top_m, seed=seed, progress=False).fit(
            self.idc_models[model_name], self.analysis)

    @functools.lru_cache(maxsize=None)
    def criteria(self, model_name: str) -> ClassicCoverage:
        """NC, KMNC, NBC, SNAC, TKNC, LSC and DSC fitted on the analysis set (reference defaults)."""
        return ClassicCoverage(progress=False).fit(self.idc_models[model_name], self.analysis)

    @functools.lru_cache(maxsize=None)
    def reference_traces(self, model_name: str, layer: str | None = None):
        """The paper-era protocol's reference relevance and per-class fits for one layer (default subject layer)."""
        from benchmarks.reproduce.idc_paper_era import ReferenceTraces

        return ReferenceTraces(self.idc_models[model_name], self.analysis, layer)

    @functools.lru_cache(maxsize=None)
    def relevant_mask(self, model_name: str, fraction: float) -> np.ndarray:
        """(N, H, W) mask of each U_O input's most relevant pixels (input LRP), at most ``fraction``."""
        return relevant_pixel_mask(self.idc_models[model_name], self.test.images, fraction)

    def accuracy(self, model_name: str) -> float:
        model = self.idc_models[model_name]
        return float((model.classifier().predict(self.test.images) == self.test.labels).mean())


def _named(model: TorchModel, name: str) -> TorchModel:
    model.name = name
    return model
