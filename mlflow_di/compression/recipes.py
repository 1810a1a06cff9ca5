"""int8-static recipes: the choices ONNX Runtime's quantizer offers, named, and which of them saturate.

ONNX Runtime's x86 int8 kernels multiply uint8 activations by int8 weights (``u8s8``; int8
activations are shifted to uint8 first). On a CPU with AVX2 or AVX-512 but without VNNI they use
``VPMADDUBSW``, which adds two 8-bit products into a *saturating* int16: with full-range int8
weights the sum can exceed 32,767 and is clipped. The same export then answers differently on a
CPU with VNNI (or AMX, or on ARM), where the products are accumulated in int32. Measured on the
DeepImportance LeNets (``benchmarks/RESULTS.md``, bench_recipes): the ``s8s8`` recipe disagrees
with the float model on 28 (LeNet-5) / 65 (LeNet-1) of 5,000 MNIST test images on a CPU without
VNNI, and on 3 / 6 with VNNI. Two recipes cannot saturate:

- ``reduce_range``: 7-bit weights (|w| <= 64), so a pair of products stays below 32,767;
- ``uint8`` weights: ONNX Runtime then uses its ``u8u8`` kernels, which widen to int16 before
  multiplying.

The default recipe is :data:`DEFAULT_RECIPE` (``u8u8``): the same answers on every CPU (3 / 7
disagreements on both kinds of CPU), and not slower than ``s8s8`` where it was measured.
"""
from __future__ import annotations

import dataclasses

from mlflow_di.errors import UserError
from mlflow_di.results_json import JsonRoundTrip

CALIBRATIONS = ("minmax", "entropy", "percentile")
TYPES = ("int8", "uint8")


@dataclasses.dataclass(frozen=True)
class Recipe(JsonRoundTrip):
    """How an int8-static export is made: element types, weight range, granularity, calibration.

    ``symmetric_activations`` / ``symmetric_weights``: None leaves ONNX Runtime's default
    (activations asymmetric; weights symmetric when signed, asymmetric when unsigned).
    """

    name: str = "u8u8"
    activations: str = "uint8"
    weights: str = "uint8"
    reduce_range: bool = False
    per_channel: bool = True
    calibration: str = "minmax"
    symmetric_activations: bool | None = None
    symmetric_weights: bool | None = None

    def __post_init__(self):
        for field, value in (("activations", self.activations), ("weights", self.weights)):
            if value not in TYPES:
                raise UserError(f"int8 recipe: {field} must be one of {', '.join(TYPES)}, got '{value}'")
        if self.calibration not in CALIBRATIONS:
            raise UserError(f"unknown calibration method '{self.calibration}'; known: {', '.join(CALIBRATIONS)}")

    @property
    def may_saturate(self) -> bool:
        """Whether ONNX Runtime's u8s8 kernels can saturate on an x86 CPU without VNNI: int8 weights of full range."""
        return self.weights == "int8" and not self.reduce_range

    def quantize_static_kwargs(self) -> dict:
        """The keyword arguments of ``onnxruntime.quantization.quantize_static`` this recipe sets."""
        from onnxruntime.quantization import CalibrationMethod, QuantType

        types = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
        method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                  "percentile": CalibrationMethod.Percentile}[self.calibration]
        extra = {}
        if self.symmetric_activations is not None:
            extra["ActivationSymmetric"] = self.symmetric_activations
        if self.symmetric_weights is not None:
            extra["WeightSymmetric"] = self.symmetric_weights
        return {"activation_type": types[self.activations], "weight_type": types[self.weights],
                "reduce_range": self.reduce_range, "per_channel": self.per_channel, "calibrate_method": method,
                "extra_options": extra}

    def params(self) -> dict:
        """What the export's lineage records about the recipe."""
        params = {"recipe": self.name, "activations": self.activations, "weights": self.weights,
                  "reduce_range": self.reduce_range, "per_channel": self.per_channel, "calibration": self.calibration}
        for name in ("symmetric_activations", "symmetric_weights"):
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        return params


#: Named recipes, the default first. ``s8s8`` is ONNX Runtime's documented default for x86.
RECIPES = {
    "u8u8": Recipe("u8u8", "uint8", "uint8"),
    "s8s8": Recipe("s8s8", "int8", "int8"),
    "s8s8-reduced": Recipe("s8s8-reduced", "int8", "int8", reduce_range=True),
    "u8s8-reduced": Recipe("u8s8-reduced", "uint8", "int8", reduce_range=True),
}
DEFAULT_RECIPE = "u8u8"


def recipe(name: str = DEFAULT_RECIPE, **overrides) -> Recipe:
    """The named recipe with ``overrides`` (fields of :class:`Recipe`; None values ignored); a UserError
    lists the names for an unknown one."""
    if name not in RECIPES:
        raise UserError(f"unknown int8 recipe '{name}'; known: {', '.join(RECIPES)}")
    chosen = {key: value for key, value in overrides.items() if value is not None}
    return dataclasses.replace(RECIPES[name], **chosen) if chosen else RECIPES[name]


def alternatives(first: Recipe, host_saturates: bool = True) -> list[Recipe]:
    """The recipes a bounded search tries after ``first`` before keeping layers in float: the named
    recipes that do not saturate, with ``first``'s granularity and calibration; on a host whose u8s8
    kernels do not saturate (``host_saturates`` False: VNNI, AMX, ARM), the ones that would saturate
    elsewhere too, last (the export's report then says so)."""
    keep = {"per_channel": first.per_channel, "calibration": first.calibration}
    tried = [first]
    for preset in sorted(RECIPES.values(), key=lambda recipe: recipe.may_saturate):
        candidate = dataclasses.replace(preset, **keep)
        if (not candidate.may_saturate or not host_saturates) and candidate not in tried:
            tried.append(candidate)
    return tried[1:]


def portability_note(recipe: Recipe, host_saturates: bool) -> str:
    """One line when an export made with ``recipe`` answers differently on x86 CPUs without VNNI ('' otherwise)."""
    if not recipe.may_saturate:
        return ""
    where = ("this host's do too" if host_saturates else
             "this host has an int8 dot product, so its figures hold only on such CPUs")
    return (f"recipe {recipe.name} uses full-range int8 weights: ONNX Runtime's u8s8 kernels saturate on x86 CPUs "
            f"with AVX2 but no VNNI ({where}); deploy it on CPUs with VNNI/AMX or ARM, or use --recipe u8u8")


def recipe_from_options(name: str, calibration: str, per_tensor: bool, activation_symmetry: str,
                        weight_symmetry: str) -> Recipe:
    """The :class:`Recipe` compress's options describe (``auto`` symmetry: ONNX Runtime's default)."""
    symmetry = {"auto": None, "symmetric": True, "asymmetric": False}
    return recipe(name, calibration=calibration, per_channel=False if per_tensor else None,
                  symmetric_activations=symmetry[activation_symmetry], symmetric_weights=symmetry[weight_symmetry])
