"""A pipeline policy: what ``mlflow-di pipeline`` runs for a model, read from a YAML file.

Pure: YAML in, frozen dataclasses out. Every section is optional but ``gate``; a key a section
does not know or a value of the wrong shape is a :class:`UserError` of one line that names the file and
the key path (``policy.yaml: fuzz.max_queries must be an integer, got 'ten'``).

Each section's keys are the options of the command it runs, with underscores (``calib_data`` is
``compress --calib-data``), and hold no default or range of their own: a key left out gets the option's
default, and a value's range, like the names a list may hold (compression methods, criteria, strategies,
corruptions), is checked by the option's own type (``commands/pipeline.py``, before any step runs, naming
the same key path). The exceptions are ``compress.methods`` (the repeatable ``--method``) and
``gate.thresholds`` (the mapping of ``--min-idc`` and the other thresholds, checked by the gate's own
records). The ``trust`` section is not a step: ``trust.pickled_models`` names the registered models whose
pickled PyTorch versions the pipeline may load (loading a pickle runs its code; see
:func:`mlflow_di.models.loading.only_trusted_pickles`). The ``preprocessing`` section is not a step
either: it maps a registered model's name to the preprocessing fields its steps use (``digits-cnn:
{mean: [0.1307], std: [0.3081]}``), above what the model records and below a command-line option (see
docs/how-to/your-own-models.md). Nor are ``evidence`` (how many times the gate may look at growing fuzz
evidence, :class:`EvidencePolicy`) and ``ray`` (where the steps' work runs, :class:`RayPolicy`), the
policy's own settings, with their own defaults and ranges.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib
import reprlib

from mlflow_di.errors import UserError
from mlflow_di.gate import Thresholds, threshold_records

#: The steps in the order they run; a step runs when its section is present (the gate always).
STEPS = ("compress", "coverage", "fuzz", "realism", "robustness", "gate")


def _kind(kind: str, default=dataclasses.MISSING):
    return dataclasses.field(default=default, metadata={"kind": kind})


@dataclasses.dataclass(frozen=True)
class CompressPolicy:
    methods: tuple = _kind("names")
    calib_data: str | None = _kind("text", None)
    eval_data: str | None = _kind("text", None)
    amount: float | None = _kind("number", None)
    max_accuracy_drop: float | None = _kind("number", None)
    max_disagreement_rate: float | None = _kind("number", None)
    max_realistic_success_rate: float | None = _kind("number", None)
    holdout_data: str | None = _kind("text", None)
    fuzz_seeds: int | None = _kind("integer", None)
    #: which answers a bound judges (compress --semantics: host, reference or both)
    semantics: str | None = _kind("text", None)
    #: measure each export's latency, size and memory beside its source's (compress --benefit)
    benefit: bool | None = _kind("boolean", None)
    #: the runtimes each export is scored on, the first one's figures its own (compress --runtime)
    runtimes: tuple | None = _kind("names", None)
    #: the compression methods' own options, each a key of its own in the section (``recipe: s8s8`` is
    #: ``compress --recipe s8s8``): {field: value}, checked against the methods' declarations by the pipeline
    method_options: dict = dataclasses.field(default_factory=dict, metadata={"kind": "method options"})

    @property
    def bounded(self) -> bool:
        """Whether the int8-static export must meet a bound (``compress --max-accuracy-drop`` and the like)."""
        return any(bound is not None for bound in
                   (self.max_accuracy_drop, self.max_disagreement_rate, self.max_realistic_success_rate))


@dataclasses.dataclass(frozen=True)
class CoveragePolicy:
    train_data: str = _kind("text")
    test_data: tuple = _kind("texts")
    criteria: tuple | None = _kind("names", None)
    layer: str | None = _kind("text", None)
    top_m: int | None = _kind("integer", None)
    clusters: tuple | None = _kind("integers", None)
    per_class: bool | None = _kind("boolean", None)
    seed: int | None = _kind("integer", None)
    #: resamples of the training data behind reachable IDC's 95% interval (coverage --idc-resamples)
    idc_resamples: int | None = _kind("integer", None)
    #: the criteria's own settings, {field: value} (coverage --criterion-setting FIELD=VALUE), e.g. kmnc_sections
    criterion_settings: dict | None = _kind("settings", None)


@dataclasses.dataclass(frozen=True)
class FuzzPolicy:
    seed_data: str = _kind("text")
    num_seeds: int | None = _kind("integer", None)
    timeout: float | None = _kind("number", None)
    max_queries: int | None = _kind("integer", None)
    #: None: the fuzz command's default strategy (mlflow_di.fuzz.strategies.DEFAULT)
    strategy: str | None = _kind("text", None)
    #: the realism budget the search keeps to (fuzz --max-linf / --min-ssim; dflare strategies and boundary)
    max_linf: int | None = _kind("integer", None)
    min_ssim: float | None = _kind("number", None)
    batch: int | None = _kind("integer", None)
    seed: int | None = _kind("integer", None)
    #: how ONNX exports answer (fuzz --semantics: host or reference)
    semantics: str | None = _kind("text", None)
    #: the runtime the exports run on, NAME[:PRECISION] (fuzz --runtime; default ONNX Runtime)
    runtime: str | None = _kind("text", None)


@dataclasses.dataclass(frozen=True)
class RealismPolicy(FuzzPolicy):
    """A second fuzz campaign, inside a realism budget: the evidence ``gate.thresholds.max_realistic_success_rate``
    judges (a campaign that did not search inside the budget cannot show that no realistic deviation
    exists). The budget is the gate's (``gate.realism_budget``, default L-inf <= 32 and SSIM >= 0.9, SSIM
    left out on images too small for it) unless ``max_linf``/``min_ssim`` name one here; by default the
    declared realism strategy (:data:`mlflow_di.fuzz.strategies.REALISM`) searches it, on
    :data:`mlflow_di.fuzz.contract.REALISM_SEEDS` seeds."""


@dataclasses.dataclass(frozen=True)
class RobustnessPolicy:
    data: str = _kind("text")
    corruptions: tuple | None = _kind("names", None)
    severities: tuple | None = _kind("integers", None)
    num_images: int | None = _kind("integer", None)
    seed: int | None = _kind("integer", None)


@dataclasses.dataclass(frozen=True)
class GatePolicy:
    thresholds: dict = _kind("thresholds")
    baseline: str | None = _kind("text", None)
    baseline_optional: bool | None = _kind("boolean", None)
    promote_alias: str | None = _kind("text", None)
    #: which answers of an int8 export the compress checks judge (gate --semantics: host, reference or both)
    semantics: str | None = _kind("text", None)
    #: judge compress figures measured on calibration or training data (gate --allow-calibration-evidence)
    allow_calibration_evidence: bool | None = _kind("boolean", None)
    #: exports of the model the gate does not judge, each named (gate --exclude-export)
    exclude_export: tuple | None = _kind("texts", None)
    #: the budget max_realistic_success_rate judges, e.g. "linf=32,ssim=0.9" (gate --realism-budget)
    realism_budget: str | None = _kind("text", None)
    #: how a check whose interval holds its threshold counts (gate --inconclusive: inconclusive, fail, pass, error)
    inconclusive: str | None = _kind("text", None)
    #: judge the exports' answers on this runtime only (gate --runtime; default: each figure's own, named)
    runtime: str | None = _kind("text", None)


@dataclasses.dataclass(frozen=True)
class EvidencePolicy:
    """How much evidence the pipeline may gather for a check its first gate cannot decide (not a step). With
    ``rounds`` above 1, a fuzz or realism step whose check is INCONCLUSIVE runs again on ``growth`` times its
    seeds (its campaign extended, up to every image of its seed data) and the gate looks again, at most
    ``rounds`` times, stopping as soon as every check is decided. Each look at growing evidence costs error:
    the fuzz steps' intervals are then made at confidence 1 - 0.05/rounds (Bonferroni over the planned looks),
    so the verdict's error stays at most 5% whichever look decides."""

    rounds: int = _kind("positive integer", 1)
    growth: int = _kind("positive integer", 2)

    @property
    def confidence(self) -> float:
        """The fuzz steps' interval confidence: 0.95 for one look, 1 - 0.05/rounds for several."""
        return 1 - 0.05 / self.rounds


@dataclasses.dataclass(frozen=True)
class RayPolicy:
    """Where the fuzz, realism and coverage steps spread their work (not a step): ``workers`` Ray workers (0:
    everything in the pipeline's own process) on the cluster at ``address`` (``local``: one started on this
    machine; ``auto``; ``ray://HOST:PORT``), each reserving ``cpus_per_worker`` and ``gpus_per_worker``; the
    coverage step's trace files in ``trace_dir``. The steps' records are the same as without Ray (the
    commands' ``--workers`` guarantee)."""

    workers: int = _kind("integer", 0)
    address: str | None = _kind("text", None)
    cpus_per_worker: float | None = _kind("positive number", None)
    gpus_per_worker: float | None = _kind("positive number", None)
    #: where the coverage step's workers write their trace files: a folder every node sees (coverage --trace-dir)
    trace_dir: str | None = _kind("text", None)

    def arguments(self, step: str) -> dict:
        """The Ray options of ``step``'s command (``--workers``, ``--ray-address``, ... and, for coverage,
        ``--trace-dir``), those the policy sets."""
        given = {"workers": self.workers, "ray_address": self.address, "cpus_per_worker": self.cpus_per_worker,
                 "gpus_per_worker": self.gpus_per_worker, "trace_dir": self.trace_dir if step == "coverage" else None}
        return {key: value for key, value in given.items() if value is not None} if self.workers else {}


@dataclasses.dataclass(frozen=True)
class TrustPolicy:
    """Which pickled models the pipeline may load. A pickle runs code when loaded, and a pipeline (or
    the service) loads whatever version it is given, so a pickled PyTorch model loads only when its
    registered model is listed here; ONNX and TFLite models need no trust, nor pt2 archives that
    hold only weights (one that holds more is read only when listed here)."""

    pickled_models: tuple = _kind("texts", ())


SECTIONS = {"trust": TrustPolicy, "evidence": EvidencePolicy, "ray": RayPolicy, "compress": CompressPolicy,
            "coverage": CoveragePolicy, "fuzz": FuzzPolicy, "realism": RealismPolicy, "robustness": RobustnessPolicy,
            "gate": GatePolicy}


@dataclasses.dataclass(frozen=True)
class Policy:
    gate: GatePolicy
    compress: CompressPolicy | None = None
    coverage: CoveragePolicy | None = None
    fuzz: FuzzPolicy | None = None
    realism: RealismPolicy | None = None
    robustness: RobustnessPolicy | None = None
    trust: TrustPolicy = TrustPolicy()
    evidence: EvidencePolicy = EvidencePolicy()
    ray: RayPolicy = RayPolicy()
    #: (registered model name, {preprocessing field: value or list}) pairs, as the file states them
    preprocessing: tuple = ()
    source: str = "policy"  # the file it came from, for messages
    sha256: str = ""  # of the file's bytes: a changed policy starts a pipeline over

    @property
    def steps(self) -> tuple[str, ...]:
        """The steps this policy runs, in order."""
        return tuple(step for step in STEPS if getattr(self, step) is not None)

    @property
    def trusted_pickles(self) -> tuple[str, ...]:
        """Registered models whose pickled versions the pipeline may load (``trust.pickled_models``)."""
        return self.trust.pickled_models

    def preprocessing_of(self, model_name: str | None) -> str | None:
        """The preprocessing the policy states for the registered model ``model_name`` as the commands'
        ``--preprocessing`` override (``mean=0.5,std=0.25``), or None."""
        fields = dict(self.preprocessing).get(model_name)
        return None if fields is None else _override_text(fields)

    def to_dict(self) -> dict:
        """The policy as a YAML-ready mapping (sections present only, lists as lists)."""
        out = {"trust": {"pickled_models": list(self.trusted_pickles)}} if self.trusted_pickles else {}
        if self.evidence != EvidencePolicy():
            out["evidence"] = dataclasses.asdict(self.evidence)
        if self.ray != RayPolicy():
            out["ray"] = {key: value for key, value in dataclasses.asdict(self.ray).items() if value is not None}
        if self.preprocessing:
            out["preprocessing"] = {name: dict(fields) for name, fields in self.preprocessing}
        for step in self.steps:
            section = dataclasses.asdict(getattr(self, step))
            section.update(section.pop("method_options", {}))  # each method's option a key of the section
            out[step] = {key: list(value) if isinstance(value, tuple) else value for key, value in section.items()}
        return out


def load_policy(path: str | pathlib.Path) -> Policy:
    """Read and check the policy file at ``path``."""
    from mlflow_di.input_files import read_bounded

    path = pathlib.Path(path)
    return parse_policy(read_bounded(path, MAX_POLICY_BYTES, "policy"), path.name)


#: A policy is a few hundred bytes; a file far bigger is a mistake (or an attack on the service).
MAX_POLICY_BYTES = 64 * 1024
#: Values a policy may hold once its YAML aliases are expanded ("billion laughs": a 463-byte file
#: of nested aliases expands to millions of values and kept the pipeline busy for minutes).
MAX_POLICY_VALUES = 10_000
#: Characters one value may have: paths and data specs are short, and a number of thousands of digits
#: cannot even be converted (Python refuses integers of more than 4,300 digits).
MAX_SCALAR_CHARACTERS = 1_000


def parse_policy(content: bytes | str, source: str = "policy") -> Policy:
    """Check the YAML text ``content`` (``source`` names it in messages) and build the :class:`Policy`.

    The file is bounded before anything is built from it: at most :data:`MAX_POLICY_BYTES`, and
    at most :data:`MAX_POLICY_VALUES` values counted with every alias expanded (counted on the
    composed node graph, where an alias is one shared node, so counting costs what the file does).
    """
    import yaml

    raw = content.encode() if isinstance(content, str) else content
    if len(raw) > MAX_POLICY_BYTES:
        raise UserError(f"{source}: {len(raw):,} bytes is too big for a policy (at most {MAX_POLICY_BYTES:,}); "
                        "check that this is the policy file")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{source}: not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); a policy is "
                        "a YAML text file") from None
    bad = next((c for c in text if (ord(c) < 32 and c not in "\t\n\r") or c == "\x7f"), None)
    if bad is not None:
        line = text[:text.index(bad)].count("\n") + 1
        raise UserError(f"{source}: a control character ({bad!r}) on line {line}; a policy is plain YAML text") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _count_values(node, source, {})
        document = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{source}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise UserError(f"{source}: nested too deeply to be a policy") from None
    finally:
        loader.dispose()
    return from_mapping(document, source, hashlib.sha256(raw).hexdigest())


def _count_values(node, source: str, counted: dict) -> int:
    """Values under ``node`` with aliases expanded; a UserError beyond :data:`MAX_POLICY_VALUES`
    or for an alias that contains itself. ``counted``: node id -> count (None while counting)."""
    import yaml

    key = id(node)
    if key in counted:
        if counted[key] is None:
            raise UserError(f"{source}: a YAML alias refers to a value that contains it; a policy cannot be recursive")
        return counted[key]
    counted[key] = None
    if isinstance(node, yaml.MappingNode):
        _no_duplicate_keys(node, source)
    if isinstance(node, yaml.ScalarNode) and len(node.value) > MAX_SCALAR_CHARACTERS:
        raise UserError(f"{source}: the value on line {node.start_mark.line + 1} is {len(node.value):,} characters long "
                        f"(at most {MAX_SCALAR_CHARACTERS:,}); a policy's values are short names, paths and numbers")
    children = (node.value if isinstance(node, yaml.SequenceNode)
                else [item for pair in node.value for item in pair] if isinstance(node, yaml.MappingNode) else [])
    total = 1
    for child in children:
        total += _count_values(child, source, counted)
        if total > MAX_POLICY_VALUES:
            raise UserError(f"{source}: its YAML aliases expand to more than {MAX_POLICY_VALUES:,} values; "
                            "a policy needs a few dozen, write the values out")
    counted[key] = total
    return total


def _no_duplicate_keys(node, source: str) -> None:
    """A UserError naming a key a YAML mapping states twice: YAML keeps the last one silently, so a second
    ``gate:`` section would replace the first (and its thresholds) without a word."""
    seen = {}
    for key, _ in node.value:
        name = getattr(key, "value", None)
        if not isinstance(name, str):
            continue
        if name in seen:
            raise UserError(f"{source}: '{name}' is given twice (lines {seen[name] + 1} and {key.start_mark.line + 1}); "
                            "keep one")
        seen[name] = key.start_mark.line


def from_mapping(document, source: str = "policy", sha256: str = "") -> Policy:
    """Build the :class:`Policy` from an already parsed mapping (see :func:`parse_policy`)."""
    if not isinstance(document, dict):
        raise UserError(f"{source}: a policy is a mapping of sections ({', '.join(STEPS)}), got {_shown(document)}")
    _no_unknown(document, [*SECTIONS, "preprocessing"], source, "", "section")
    if "gate" not in document:
        raise UserError(f"{source}: the gate section is required (gate: {{thresholds: {{min_idc: 0.5}}}})")
    sections = {name: _section(name, document[name], SECTIONS[name], source) for name in document
                if name != "preprocessing"}
    if "preprocessing" in document:
        sections["preprocessing"] = _preprocessing(document["preprocessing"], source)
    if "evidence" in sections and sections["evidence"].growth < 2:
        raise UserError(f"{source}: evidence.growth must be at least 2 (each round multiplies the seeds), got "
                        f"{sections['evidence'].growth}")
    if "ray" in sections:
        _check_ray(sections["ray"], source)
    for step in ("fuzz", "realism"):
        if step in sections and "compress" not in sections:
            raise UserError(f"{source}: {step} needs a compress section (the exports to fuzz against the model)")
    if "compress" in sections and sections["compress"].bounded:  # what each method needs: the pipeline's declarations
        compress = sections["compress"]
        if not compress.holdout_data:
            raise UserError(f"{source}: compress.holdout_data is required with a bound (images the search does not "
                            "see, which verify the bounded export)")
    return Policy(**sections, source=source, sha256=sha256)


def _check_ray(ray: RayPolicy, source: str) -> None:
    from mlflow_di._ray import check_address

    if ray.workers < 0:
        raise UserError(f"{source}: ray.workers must be 0 (no Ray) or more, got {ray.workers}")
    try:
        check_address(ray.address)
    except UserError as exc:
        raise UserError(f"{source}: ray.address: {exc}") from None


def _section(name: str, values, cls, source: str):
    if not isinstance(values, dict):
        raise UserError(f"{source}: {name} must be a mapping of keys, got {_shown(values)}")
    declared = {field.name: field for field in dataclasses.fields(cls)}
    fields = {key: field for key, field in declared.items() if field.metadata["kind"] != "method options"}
    extra = {}
    if "method_options" in declared:  # the section takes the compression methods' own options as keys of its own
        extra = {"method_options": _method_options(values, fields, source)}
        values = {key: value for key, value in values.items() if key in fields}
    _no_unknown(values, fields, source, f"{name}.", "key")
    for field in fields.values():
        if field.default is dataclasses.MISSING and field.name not in values:
            raise UserError(f"{source}: {name}.{field.name} is required")
    return cls(**{key: _value(f"{name}.{key}", value, fields[key].metadata["kind"], source)
                  for key, value in values.items()}, **extra)


def _method_options(values: dict, fields: dict, source: str) -> dict:
    """The compress section's keys that are not its own: the compression methods' own options (``recipe``), each
    a value or a list of values here. Which keys the declared methods hold, and each value's range, are checked
    by the pipeline with compress's options (a foundation does not read the engines' declarations)."""
    own = {key: value for key, value in values.items() if key not in fields}
    for key, value in own.items():
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(item, (str, int, float, bool)) for item in items):
            raise UserError(f"{source}: compress.{key} must be a value or a list of values, got {_shown(value)}")
    return own


def _preprocessing(values, source: str) -> tuple:
    """``preprocessing:`` -> ((model name, fields), ...), each checked as the option would be."""
    from mlflow_di.models.preprocessing import Preprocessing

    if not isinstance(values, dict) or not values:
        raise UserError(f"{source}: preprocessing must map registered model names to preprocessing fields, "
                        f"e.g. preprocessing: {{digits-cnn: {{mean: [0.5], std: [0.25]}}}}; got {_shown(values)}")
    known = [field.name for field in dataclasses.fields(Preprocessing)]
    pairs = []
    for name, fields in values.items():
        path = f"preprocessing.{name}"
        if not isinstance(fields, dict) or not fields:
            raise UserError(f"{source}: {path} must be a mapping of preprocessing fields ({', '.join(known)}), "
                            f"got {_shown(fields)}")
        _no_unknown(fields, known, source, f"{path}.", "key")
        for key, value in fields.items():
            items = value if isinstance(value, list) else [value]
            if not items or not all(isinstance(item, (str, int, float)) and not isinstance(item, bool) for item in items):
                raise UserError(f"{source}: {path}.{key} must be a value or a list of values, got {_shown(value)}")
        try:
            Preprocessing().override(_override_text(fields))
        except UserError as exc:
            raise UserError(f"{source}: {path}: {exc}") from None
        pairs.append((str(name), dict(fields)))
    return tuple(pairs)


def _override_text(fields: dict) -> str:
    """A policy's preprocessing fields as the ``--preprocessing`` text (lists joined with ``/``)."""
    return ",".join(f"{key}={'/'.join(str(item) for item in (value if isinstance(value, list) else [value]))}"
                    for key, value in fields.items())


def _no_unknown(values: dict, known, source: str, prefix: str, what: str) -> None:
    for key in values:
        if key not in known:
            raise UserError(f"{source}: unknown {what} {prefix}{key}; known: {', '.join(known)}")


def _value(path: str, value, kind: str, source: str):
    """``value`` of key ``path`` as ``kind`` wants it (None stays None: the option's default)."""
    def bad(expected: str):
        return UserError(f"{source}: {path} must be {expected}, got {_shown(value)}")

    if value is None:
        return None
    if kind == "text":
        if not isinstance(value, str) or not value.strip():
            raise bad("a non-empty string")
        return value
    if kind in ("texts", "names"):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(v, str) and v.strip() for v in items):
            raise bad("a list of non-empty strings")
        return tuple(dict.fromkeys(items) if kind == "names" else items)
    if kind == "integers":
        if not isinstance(value, list) or not value or not all(_is_int(v) for v in value):
            raise bad("a list of integers")
        return tuple(value)
    if kind == "boolean":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if kind in INTEGER_RANGES:
        accepts, wanted = INTEGER_RANGES[kind]
        if not _is_int(value) or not accepts(value):
            raise bad(wanted)
        return value
    if kind in NUMBER_RANGES:
        accepts, wanted = NUMBER_RANGES[kind]
        if not _is_number(value) or not accepts(value):
            raise bad(wanted)
        return float(value)
    if kind == "settings":
        if not isinstance(value, dict) or not value or not all(
                isinstance(key, str) and isinstance(item, (str, int, float, bool)) for key, item in value.items()):
            raise bad("a mapping of setting names to values, e.g. {kmnc_sections: 100}")
        return dict(value)
    if kind == "thresholds":
        return _thresholds(path, value, source)
    raise AssertionError(f"unknown kind {kind}")  # pragma: no cover - a field declared wrongly


def _thresholds(path: str, value, source: str) -> dict:
    known = set(threshold_records())
    if not isinstance(value, dict) or not value:
        raise UserError(f"{source}: {path} must be a mapping of at least one threshold ({', '.join(sorted(known))}), "
                        f"got {_shown(value)}")
    _no_unknown(value, sorted(known), source, f"{path}.", "threshold")
    for name, number in value.items():
        if not _is_number(number):
            raise UserError(f"{source}: {path}.{name} must be a number, got {_shown(number)}")
    try:
        Thresholds(**value)
    except UserError as exc:  # its message names the option: "--min-idc is a fraction ..."
        option, _, message = str(exc).partition(" ")
        if not option.startswith("--"):
            raise UserError(f"{source}: {path}: {exc}") from None
        raise UserError(f"{source}: {path}.{option[2:].replace('-', '_')} {message}") from None
    return {name: float(number) for name, number in value.items()}


#: An integer kind: (whether a value is in its range, what the error says it must be); as NUMBER_RANGES. A key
#: that stands for a command option is only "integer" or "number" here: its range is the option's own, checked
#: by ``commands/pipeline.py`` with the option's type before any step runs. The positive kinds are for the
#: policy's own settings (``evidence``, ``ray``), which no command has.
INTEGER_RANGES = {
    "integer": (lambda value: True, "an integer"),
    "positive integer": (lambda value: value >= 1, "a positive integer"),
}
NUMBER_RANGES = {
    "number": (lambda value: True, "a number"),
    "positive number": (lambda value: value > 0, "a positive number"),
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: Shows a value in a message without walking all of it (a value can hold thousands of items).
_SHORT = reprlib.Repr()  # (keyword arguments to Repr need Python 3.12)
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 2, 4, 4, 4, 4
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 40


def _shown(value) -> str:
    text = _SHORT.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
