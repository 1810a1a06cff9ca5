"""One contract suite over every declared thing, built-in or registered, of each kind: fuzzing strategies,
compression methods, coverage criteria, gate checks and relative checks, model formats, runtimes and data sources.
A registry is parametrized as it stands when the tests are collected, so a declaration added to the product is
checked without naming it here; each passes the checks of its kind (what its declaration promises the code that
reads it), and every registry refuses an unknown name in one line that lists the declared ones."""
import dataclasses
import json

import click
import pytest

from mlflow_di.compression.declarations import METHODS
from mlflow_di.compression.methods import MethodJob
from mlflow_di.coverage.criteria import CRITERION
from mlflow_di.data import SOURCES
from mlflow_di.errors import UserError
from mlflow_di.fuzz import strategies
from mlflow_di.fuzz.contract import Access, Strategy
from mlflow_di.gate import CHECKS, RANGES, RELATIONS, Thresholds
from mlflow_di.models.formats import FORMATS
from mlflow_di.models.runtimes import RUNTIMES, RuntimeChoice
from mlflow_di.registry import Registry

REGISTRIES = {"strategy": strategies.DECLARATIONS, "method": METHODS, "criterion": CRITERION, "check": CHECKS,
              "relation": RELATIONS, "format": FORMATS, "runtime": RUNTIMES, "source": SOURCES}


def _declared(kind: str) -> list:
    return [pytest.param(name, id=f"{kind}:{name}") for name in REGISTRIES[kind]]


@pytest.mark.parametrize("kind", list(REGISTRIES))
def test_every_registry_refuses_an_unknown_name_in_one_line_listing_the_declared_ones(kind):
    registry = REGISTRIES[kind]
    assert isinstance(registry, Registry) and registry.builtins and set(registry.builtins) <= set(registry)
    with pytest.raises(UserError) as refused:
        registry.require("no-such-thing")
    message = str(refused.value)
    assert "\n" not in message and "no-such-thing" in message and all(name in message for name in registry)
    first = registry.builtins[0]
    registry.unregister(first)  # a built-in stays
    assert registry.require(first) is registry[first]
    with pytest.raises(UserError, match=f"is declared with a {registry.kind.__name__}"):
        registry.register(object())


@pytest.mark.parametrize("name", _declared("strategy"))
def test_every_strategy_makes_a_strategy_that_says_what_it_records(name):
    declared = strategies.declaration(name)
    strategy = declared.make()
    assert declared.summary and isinstance(strategy, Strategy)
    assert strategies.declaration_of(strategy) is declared
    json.dumps(strategy.options(), default=str)  # a campaign records them
    assert isinstance(declared.original, Access) and isinstance(declared.compressed, Access)
    assert isinstance(declared.run, str) or callable(declared.run)
    assert declared.folder_label(strategy).startswith(name) or declared.label is not None
    for spec in declared.options:  # its own options: each default, the strategy object's field, in its own range
        assert declared.option_prefix, f"{name} declares options without a prefix for their flags"
        default = getattr(strategy, spec.field)
        assert spec.check(default, name) == (tuple(default) if isinstance(default, list) else default)


@pytest.mark.parametrize("name", _declared("method"))
def test_every_method_says_what_it_needs_and_exports_through_one_job(name):
    import pkgutil

    from mlflow_di.commands import compress

    declared = METHODS[name]
    export = pkgutil.resolve_name(declared.export) if isinstance(declared.export, str) else declared.export
    assert declared.summary and callable(export)
    options = {param.name: param for param in compress.command.params}
    for spec in declared.options:  # each own option is compress's --FIELD, its default inside its range
        assert spec.field in options and options[spec.field].default == spec.default, spec.field
        assert spec.check(spec.default, name) == spec.default
    defaults = declared.configure()
    assert defaults == declared.configure({spec.field: spec.default for spec in declared.options})
    assert dataclasses.is_dataclass(defaults) and defaults.__dataclass_params__.frozen  # a typed, frozen record
    assert all(isinstance(getattr(declared, flag), bool) for flag in ("needs_calibration", "integer", "prunes",
                                                                       "selective"))
    assert declared.made_for is None or RuntimeChoice.parse(declared.made_for).runtime.name in RUNTIMES
    assert {"module", "preprocessing", "method", "path", "calib", "keep_float"} <= set(MethodJob.__dataclass_fields__)


@pytest.mark.parametrize("name", _declared("check"))
def test_every_gate_check_is_a_gate_option_in_a_declared_range(name):
    from mlflow_di.commands import gate

    check = CHECKS[name]
    options = {param.name: param for param in gate.command.params}
    assert check.threshold_name in options and check.range in RANGES and isinstance(check.greater_is_better, bool)
    assert check.command in ("coverage", "fuzz", "compress", "robustness") and check.help
    inside = {"fraction": 0.5, "positive": 2.0, "nonnegative": 0.0}[check.range]
    assert getattr(Thresholds(**{check.threshold_name: inside}), check.threshold_name) == inside
    with pytest.raises(UserError):
        Thresholds(**{check.threshold_name: -1.0})  # outside every declared range
    with pytest.raises(click.BadParameter):
        options[check.threshold_name].type.convert("-1", options[check.threshold_name], None)


@pytest.mark.parametrize("name", _declared("relation"))
def test_every_relative_check_is_a_gate_option_of_a_known_kind(name):
    from mlflow_di.commands import gate

    relation = RELATIONS[name]
    assert relation.kind in ("drop", "rise", "ratio") and relation.range in RANGES and relation.metric in CHECKS
    assert relation.threshold_name in {param.name for param in gate.command.params}


@pytest.mark.parametrize("name", _declared("format"))
def test_every_model_format_says_how_it_opens_and_what_it_can_do(name):
    from mlflow_di.models.formats import format_of_file

    declared = FORMATS[name]
    assert declared.title and declared.made_with
    for suffix in declared.suffixes:
        assert format_of_file(f"model{suffix}") is declared
    assert isinstance(declared.runs_code, bool) and isinstance(declared.white_box, bool)


@pytest.mark.parametrize("name", _declared("runtime"))
def test_every_runtime_parses_with_each_of_its_precisions(name):
    runtime = RUNTIMES[name]
    assert runtime.title and runtime.opens and callable(runtime.open) and "cpu" in runtime.devices
    assert RuntimeChoice.parse(name).runtime is runtime
    for precision in runtime.precisions:
        assert RuntimeChoice.parse(f"{name}:{precision}").runtime is runtime
    with pytest.raises(UserError):
        RuntimeChoice.parse(f"{name}:no-such-precision")


@pytest.mark.parametrize("name", _declared("source"))
def test_every_data_source_is_written_as_its_form(name):
    source = SOURCES[name]
    assert source.form == (f"{name}:{source.argument}" if source.argument else name) and callable(source.load)
