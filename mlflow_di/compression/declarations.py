"""Every compression method's declaration, and the registry ``mlflow-di compress`` reads: what a method needs,
what it is, and its own options (:class:`~mlflow_di.settings.OptionSpec`), held once here.

=====================  ==================================================================
``fp32``               plain ONNX export (the reference the others are compared with)
``int8-static``        ONNX Runtime static QDQ 8-bit, per-channel weights, calibrated activations (a recipe)
``int8-dynamic``       ONNX Runtime dynamic int8 (int8 weights, run-time activation ranges)
``prune-l1``           global unstructured L1 magnitude pruning of Conv/Linear weights, then export
``prune-structured``   L1 output-channel pruning (all but the logit layer), then export
``int8-nncf``          NNCF's post-training int8 for OpenVINO (QDQ ONNX, scored on OpenVINO too)
=====================  ==================================================================

Light on purpose: no torch here (a built-in's ``export`` is named as ``"module:function"`` and imported when it
runs), so ``compress --help`` lists every method's options at once. ``mlflow-di compress`` builds its
``--method`` choices and each method's own options from these declarations and names no method;
:func:`register_method` adds one (a module and its declaration, no edit in ``commands/``).
"""
from __future__ import annotations

import dataclasses
import functools
import pkgutil
from typing import Callable, Mapping

from mlflow_di.compression.recipes import CALIBRATIONS, DEFAULT_RECIPE, RECIPES, recipe_from_options
from mlflow_di.errors import UserError
from mlflow_di.registry import Registry
from mlflow_di.settings import OptionSpec

_SYMMETRY = ("auto", "symmetric", "asymmetric")

#: int8-static's own options: its recipe (element types, weight range, granularity, calibration)
INT8_STATIC_OPTIONS = (
    OptionSpec("recipe", "Element types and weight range. u8u8 (uint8 weights and activations) and the -reduced "
                         "recipes (7-bit weights) give the same answers on every CPU; s8s8 (ONNX Runtime's x86 default) "
                         "saturates on x86 CPUs without VNNI. A bounded search tries the others too.",
               "choice", choices=tuple(RECIPES), default=DEFAULT_RECIPE),
    OptionSpec("calibration", "How activation ranges are calibrated.", "choice", choices=CALIBRATIONS,
               default="minmax"),
    OptionSpec("per_tensor", "One weight scale per tensor instead of per output channel.", "flag", default=False),
    OptionSpec("activation_symmetry", "Activation ranges centred on 0 or not (auto: ONNX Runtime's default, "
                                      "asymmetric).", "choice", choices=_SYMMETRY, default="auto"),
    OptionSpec("weight_symmetry", "Weight ranges centred on 0 or not (auto: symmetric for int8 weights, asymmetric "
                                  "for uint8).", "choice", choices=_SYMMETRY, default="auto"),
)


@dataclasses.dataclass(frozen=True)
class MethodDeclaration:
    """One compression method's contract.

    ``export(job)`` does the work (a function, or its ``"module:function"`` name imported when it runs): ``job``
    is a :class:`~mlflow_di.compression.methods.MethodJob` (the module, its preprocessing, the output path, the
    calibration inputs, the pruning amount, the opset, the layers to keep in float, an ONNX original's graph, an
    earlier fp32 export, the method's settings); it returns the
    :class:`~mlflow_di.compression.methods.CompressionResult` fields it determines (``params``, ``exporter``,
    and where they apply ``sparsity``, ``quantized_ops``, ``float_path``). ``needs_calibration``: refused
    without calibration data. ``integer``: runs integer kernels (its figures are also measured under
    reference semantics, the QDQ graph as written, and its portability across CPUs is stated). ``prunes``:
    takes ``--amount``. ``selective``: can keep layers in float (``--keep-float``, the layer-wise diagnosis,
    the bounded search and its recipes). ``made_for``: the runtime its exports are made for (``openvino`` for
    NNCF's int8), on which compress also scores them when that runtime is installed.

    ``options``: the method's own settings, each ``compress --FIELD`` (underscores as dashes) with its type,
    default, range and help; the policy's ``compress`` section takes them by field. :meth:`configure` turns
    their values into the frozen settings object ``job.settings`` holds: ``settings(**values)`` when given
    (int8-static: a :class:`~mlflow_di.compression.recipes.Recipe`), else a frozen record of the fields.
    """

    name: str
    summary: str
    export: Callable | str
    needs_calibration: bool = False
    integer: bool = False
    prunes: bool = False
    selective: bool = False
    made_for: str | None = None
    options: tuple[OptionSpec, ...] = ()
    settings: Callable | None = None

    def run_export(self, job) -> dict:
        """``export(job)``, the function imported first when it is named by text."""
        export = pkgutil.resolve_name(self.export) if isinstance(self.export, str) else self.export
        return export(job)

    def configure(self, values: Mapping | None = None):
        """The frozen settings object of this method's options: ``values`` (field -> value; None or missing:
        the option's default), each checked by its :class:`~mlflow_di.settings.OptionSpec`. A one-line
        UserError names an option the method does not declare."""
        values = dict(values or {})
        fields = [spec.field for spec in self.options]
        unknown = [field for field in values if field not in fields]
        if unknown:
            declared = f"its options: {', '.join(fields)}" if fields else "it declares none"
            raise UserError(f"the compression method {self.name} has no option '{unknown[0]}'; {declared}")
        checked = {spec.field: spec.default if values.get(spec.field) is None else spec.check(values[spec.field], self.name)
                   for spec in self.options}
        return (self.settings or _record_of(self.name, tuple(spec.field for spec in self.options)))(**checked)


@functools.lru_cache(maxsize=None)
def _record_of(method: str, fields: tuple[str, ...]) -> type:
    """A frozen dataclass with these fields (a method's settings when it names no type of its own); one class
    per method and fields, so two settings of the same values are equal."""
    title = "".join(part.capitalize() for part in method.replace("_", "-").split("-"))
    return dataclasses.make_dataclass(f"{title}Settings", list(fields), frozen=True)


def _int8_static_settings(recipe, calibration, per_tensor, activation_symmetry, weight_symmetry):
    """int8-static's settings: the :class:`~mlflow_di.compression.recipes.Recipe` its options describe."""
    return recipe_from_options(recipe, calibration, per_tensor=per_tensor, activation_symmetry=activation_symmetry,
                               weight_symmetry=weight_symmetry)


def register_method(declaration: MethodDeclaration) -> MethodDeclaration:
    """Declare a compression method: ``compress``, ``mlflow-di compress --method NAME`` (and its options) and
    policies know it."""
    return METHODS.register(declaration)


def unregister_method(name: str) -> None:
    """Forget a method declared with :func:`register_method` (tests); the built-ins stay."""
    METHODS.unregister(name)


def method_declaration(method: str) -> MethodDeclaration:
    """The declaration of ``method``; a UserError listing the known methods otherwise."""
    return METHODS.require(method, advice="known")


def check_method(method: str) -> str:
    """``method`` if it is known, else a UserError listing the known methods."""
    return method_declaration(method).name


def methods_that(what: str, among=None) -> list[str]:
    """The declared methods with the flag ``what`` (``needs_calibration``, ``integer``, ``prunes``, ``selective``);
    with ``among`` (declared method names), those of them that have it, in their order."""
    return [name for name in (METHODS if among is None else among) if getattr(method_declaration(name), what)]


def method_help() -> str:
    """Every declared method with its summary, for ``--method``'s help."""
    return ", ".join(f"{name} ({declared.summary})" for name, declared in METHODS.items())


def method_options() -> dict[str, tuple[str, OptionSpec]]:
    """``{field: (method, OptionSpec)}`` of every declared method's own options, in declaration order. Two
    methods declaring the same field is a one-line UserError (one ``--FIELD`` cannot mean two things)."""
    options = {}
    for name, declared in METHODS.items():
        for spec in declared.options:
            if spec.field in options:
                raise UserError(f"the compression methods {options[spec.field][0]} and {name} both declare the option "
                                f"'{spec.field}'; rename one")
            options[spec.field] = (name, spec)
    return options


_METHODS = "mlflow_di.compression.methods"

#: name -> :class:`MethodDeclaration` of every declared method (iterating gives the names), live: registering
#: one adds its name to ``--method`` and its options to the command
METHODS = Registry("compression method", MethodDeclaration, builtins=(
    MethodDeclaration("fp32", "plain ONNX export (the reference the others are compared with)",
                      f"{_METHODS}:export_fp32"),
    MethodDeclaration("int8-static", "ONNX Runtime static QDQ 8-bit, calibrated activations (a recipe)",
                      f"{_METHODS}:export_int8_static", needs_calibration=True, integer=True, selective=True,
                      options=INT8_STATIC_OPTIONS, settings=_int8_static_settings),
    MethodDeclaration("int8-dynamic", "ONNX Runtime dynamic int8 (int8 weights, run-time activation ranges)",
                      f"{_METHODS}:export_int8_dynamic", integer=True),
    MethodDeclaration("prune-l1", "global unstructured L1 magnitude pruning of Conv/Linear weights",
                      f"{_METHODS}:export_prune_l1", prunes=True),
    MethodDeclaration("prune-structured", "L1 output-channel pruning (all but the logit layer)",
                      f"{_METHODS}:export_prune_structured", prunes=True),
    MethodDeclaration("int8-nncf", "NNCF's post-training int8 for OpenVINO's CPU plugin (QDQ ONNX; the nncf extra)",
                      f"{_METHODS}:export_int8_nncf", needs_calibration=True, integer=True, made_for="openvino"),
))
