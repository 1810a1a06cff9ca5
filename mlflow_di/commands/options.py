"""Typed command-line options: each converts and validates itself (click ``ParamType``s).

A bad value becomes one line and exit code 2 before any model is loaded or any MLflow run
starts. Choices come from the engines' own registries (imported when first needed, so
``--help`` stays fast), never from hand-copied lists. One vocabulary across commands: lists are
comma-separated everywhere (``2,3,4``, ``idc,nc``, ``int8-static,prune-l1``).
"""
from __future__ import annotations

import math
import os
import pathlib
import pkgutil
import re

import click


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists some options under headings of their own after the general
    ones, so options that apply only in one mode (one strategy's settings, Ray's) stand apart.
    ``sections``: (heading, predicate on the click parameter) pairs, in the order shown, or a function
    giving them when help is shown (headings read from live declarations)."""

    def __init__(self, *args, sections=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.sections = sections if callable(sections) else tuple(sections)

    def format_options(self, ctx, formatter):
        sections = tuple(self.sections()) if callable(self.sections) else self.sections
        general, grouped = [], {heading: [] for heading, _ in sections}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            heading = next((heading for heading, belongs in sections if belongs(param)), None)
            (grouped[heading] if heading else general).append(record)
        with formatter.section("Options"):
            formatter.write_dl(general)
        for heading, records in grouped.items():
            if records:
                with formatter.section(heading):
                    formatter.write_dl(records)


class DeclaredOptionsCommand(SectionedCommand):
    """A command whose options are its own and those its declarations hold (``declared``: a function giving
    click options, e.g. every compression method's own), read when the options are: a method registered after
    the command was built brings its options, and ``params`` (help, parsing, ``ctx.invoke``'s defaults, the
    policy's checks) always lists them."""

    def __init__(self, *args, declared, **kwargs):
        self._declared, self._own, self._listed, self._names = declared, [], [], None
        super().__init__(*args, **kwargs)

    @property
    def params(self) -> list:
        options = self._declared()
        names = [option.name for option in options]
        if names != self._names:  # one list while the declarations stay the same: click appends to it and pops
            taken = [name for name in names if name in {param.name for param in self._own}]
            if taken:
                from mlflow_di.errors import UserError

                raise UserError(f"a declared option '{taken[0]}' is also an option of mlflow-di {self.name} itself; "
                                "rename it in its declaration")
            self._listed, self._names = [*self._own, *options], names
        return self._listed

    @params.setter
    def params(self, value) -> None:
        self._own, self._names = list(value), None


def stacked(options: list):
    """Several click options as one decorator, listed in ``--help`` in the order given."""
    def decorate(function):
        for option in reversed(options):
            function = option(function)
        return function
    return decorate


def declared_option(prefix: str | None, spec):
    """The click option of a declared setting (an ``OptionSpec``). A fuzz strategy's own option
    (:mod:`mlflow_di.fuzz.contract`) has its ``prefix``: ``--PREFIX-FIELD``, parameter ``PREFIX_FIELD``, default
    None (the strategy's own default applies). A compression method's (``prefix`` None) is ``--FIELD``,
    parameter ``FIELD``, with the declared default, shown."""
    dashed = spec.field.replace('_', '-')
    flag = f"--{prefix}-{dashed}" if prefix else f"--{dashed}"
    name = f"{prefix}_{spec.field}" if prefix else spec.field
    default = {} if prefix else {"default": spec.default, "show_default": spec.default is not None}
    if spec.kind == "flag":
        negative = f"--{prefix}-no-{dashed}" if prefix else f"--no-{dashed}"
        return click.option(f"{flag}/{negative}", name, help=spec.help, **({"default": None} | default))
    kinds = {
        "float": lambda: FiniteFloat(spec.low, spec.high, min_open=spec.open[0], max_open=spec.open[1]),
        "int": lambda: click.IntRange(spec.low, spec.high),
        "choice": lambda: click.Choice(list(spec.choices)),
        "floats": lambda: StepList(spec.what, spec.example),
        "pair": lambda: IntPair(spec.what, spec.example, int(spec.low or 0), spec.metavar or "ROWS,COLS"),
    }
    if spec.kind not in kinds:
        raise ValueError(f"unknown option kind '{spec.kind}' of {flag}")
    metavar = spec.metavar if spec.kind != "pair" else None
    return click.option(flag, name, type=kinds[spec.kind](), help=spec.help, **({"default": None} | default),
                        **({"metavar": metavar} if metavar else {}))


def option_of(decorator) -> click.Option:
    """The click option a ``click.option`` decorator adds, as a parameter of its own (a command's declared ones)."""
    def bare():
        """Holds the option while it is built."""
    decorator(bare)
    return bare.__click_params__[0]


def declared_options(declarations):
    """Every declared strategy's own options, as one decorator (see :func:`declared_option`)."""
    return stacked([declared_option(d.option_prefix, spec) for d in declarations if d.option_prefix for spec in d.options])



class LazyChoice(click.ParamType):
    """One name from a registry ``"module:ATTRIBUTE"`` (a dict or sequence of names).

    ``in_help=False`` for registries whose module imports torch: ``--help`` then shows the
    option's kind instead of its choices (a wrong value lists them), so help stays instant.
    """

    def __init__(self, registry: str, what: str, in_help: bool = True):
        self.registry, self.what, self.in_help = registry, what, in_help
        self.name = what

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(pkgutil.resolve_name(self.registry))

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(self.choices) + "]" if self.in_help else self.what.upper()

    def convert(self, value, param, ctx):
        if value in self.choices:
            return value
        self.fail(f"unknown {self.what} '{value}'; choose one of: {', '.join(self.choices)}", param, ctx)


class SettingAssignment(click.ParamType):
    """``FIELD=VALUE``: one of the settings a registry declares (``"module:FUNCTION"`` giving ``{field:
    OptionSpec}``), its value parsed and checked by that one table (:meth:`~mlflow_di.settings.OptionSpec.parse`).
    Returns ``(field, value)``."""

    name = "FIELD=VALUE"

    def __init__(self, settings: str, what: str):
        self.settings, self.what = settings, what

    def convert(self, value, param, ctx):
        from mlflow_di.errors import UserError

        if isinstance(value, tuple):
            return value
        field, sep, text = str(value).partition("=")
        field = field.strip()
        if not sep or not field:
            self.fail(f"give a {self.what} as FIELD=VALUE, got {value!r}", param, ctx)
        specs = pkgutil.resolve_name(self.settings)()
        if field not in specs:
            known = f"choose one of: {', '.join(specs)}" if specs else "no registered one declares a setting"
            self.fail(f"unknown {self.what} '{field}'; {known}", param, ctx)
        try:
            return field, specs[field].parse(text, self.what)
        except UserError as exc:
            self.fail(str(exc), param, ctx)


class CommaList(click.ParamType):
    """Comma-separated names, each from a registry; returned as a tuple in the order given, without repeats."""

    def __init__(self, registry: str, what: str, metavar: str, extra: tuple[str, ...] = ()):
        self.choice = LazyChoice(registry, what)
        self.extra, self.what = extra, what
        self.name = f"{metavar}[,{metavar}...]"

    def get_metavar(self, param, ctx=None) -> str:
        return self.name

    @property
    def choices(self) -> tuple[str, ...]:
        return (*self.extra, *self.choice.choices)

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        names = [item.strip() for item in str(value).split(",") if item.strip()]
        if not names:
            self.fail(f"no {self.what} given; choose from: {','.join(self.choices)}", param, ctx)
        unknown = [name for name in names if name not in self.choices]
        if unknown:
            self.fail(f"unknown {self.what} {', '.join(repr(n) for n in unknown)}; choose from: "
                      f"{','.join(self.choices)}", param, ctx)
        return tuple(dict.fromkeys(names))


class IntegerList(click.ParamType):
    """Comma-separated integers from ``minimum`` to ``maximum`` (None: no upper bound), returned
    sorted without repeats."""

    def __init__(self, what: str, example: str, minimum: int, maximum: int | None = None, metavar: str = "N"):
        self.what, self.example, self.minimum, self.maximum = what, example, minimum, maximum
        self.name = f"{metavar}[,{metavar}...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            numbers = tuple(int(item) for item in str(value).split(",") if item.strip())
        except ValueError:
            self.fail(f"must be integers separated by commas, e.g. {self.example} (got '{value}')", param, ctx)
        if not numbers or min(numbers) < self.minimum or (self.maximum is not None and max(numbers) > self.maximum):
            bounds = f"at least {self.minimum}" if self.maximum is None else f"from {self.minimum} to {self.maximum}"
            self.fail(f"each {self.what} must be {bounds}, e.g. {self.example} (got '{value}')", param, ctx)
        return tuple(sorted(set(numbers)))


class StepList(click.ParamType):
    """Comma-separated positive finite numbers in the order given (``none``: an empty tuple)."""

    name = "STEP[,STEP...]|none"

    def __init__(self, what: str, example: str):
        self.what, self.example = what, example

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        if str(value).strip().lower() == "none":
            return ()
        try:
            numbers = tuple(float(item) for item in str(value).split(",") if item.strip())
        except ValueError:
            numbers = ()
        if not numbers or not all(math.isfinite(n) and n > 0 for n in numbers):
            self.fail(f"each {self.what} must be a positive number, separated by commas, e.g. {self.example}, "
                      f"or none (got '{value}')", param, ctx)
        return numbers


class ClusterCounts(IntegerList):
    """Candidate cluster counts per neuron, e.g. ``2,3,4``: integers >= 2 (one cluster has no silhouette)."""

    def __init__(self):
        super().__init__("cluster count", "2,3,4", minimum=2, metavar="K")


class Severities(IntegerList):
    """Corruption severities, e.g. ``1,3,5``: integers from 1 to 5."""

    def __init__(self):
        super().__init__("severity", "1,3,5", minimum=1, maximum=5, metavar="S")


class LayerNames(click.ParamType):
    """``all`` or comma-separated layer names; whether they exist is checked once the model is loaded."""

    name = "all|NAME[,NAME...]"

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)) or value == "all":
            return value
        names = [item.strip() for item in str(value).split(",") if item.strip()]
        if not names:
            self.fail("give 'all' or layer names separated by commas (see `mlflow-di describe MODEL`)", param, ctx)
        return names


class WritablePath(click.ParamType):
    """A file (``kind="file"``) or folder (``kind="dir"``) the command will write, proven writable
    before any work starts: the folder is created and a probe file of one block is written there and
    removed. Asking permission bits is not enough: as root every folder "is writable", ``/proc`` and
    read-only mounts included, and a full disk passes any permission check."""

    PROBE_BYTES = 4096

    def __init__(self, kind: str = "file"):
        self.kind = kind
        self.name = "FILE" if kind == "file" else "DIR"

    def convert(self, value, param, ctx):
        if value is None or str(value).strip() == "":
            return None  # not given (MLproject passes empty strings for unset paths)
        path = pathlib.Path(value).expanduser()
        if self.kind == "file" and path.is_dir():
            self.fail(f"'{value}' is a folder; give a file name", param, ctx)
        if self.kind == "dir" and path.exists() and not path.is_dir():
            self.fail(f"'{value}' is a file; give a folder", param, ctx)
        existing = path if path.exists() else next((p for p in path.parents if p.exists()), pathlib.Path("."))
        if existing != path and not existing.is_dir():
            self.fail(f"cannot create '{value}': '{existing}' is a file, not a folder", param, ctx)
        folder = path if self.kind == "dir" else path.parent
        if self.kind == "file" and path.exists() and not path.is_file():
            problem = probe_special_file(path)  # /dev/full takes no byte; a FIFO blocks its writer
        else:
            problem = probe_writable(folder)
        if problem is None and path.exists() and not os.access(path, os.W_OK):
            problem = "the file is read-only"
        if problem:
            self.fail(f"cannot write to '{value}' ({problem}); pick a writable location", param, ctx)
        return str(path)


def probe_writable(folder: pathlib.Path) -> str | None:
    """Write, flush and remove one block in ``folder``, creating the folder for the probe and
    removing what it created afterwards (the command creates it again when it writes); None when
    that worked, else why not (the OS's reason, e.g. "No space left on device")."""
    created = []  # the folders the probe creates, deepest first
    for parent in (folder, *folder.parents):
        if parent.exists():
            break
        created.append(parent)
    probe = folder / f".mlflow-di-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(b"\0" * WritablePath.PROBE_BYTES)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        for leftover in (probe, *created):
            try:
                leftover.rmdir() if leftover.is_dir() else leftover.unlink()
            except OSError:
                pass
    return None


def probe_special_file(path: pathlib.Path) -> str | None:
    """Why the command could not write its output to ``path``, an existing file that is not a regular one
    (None for a character device that takes a block, such as ``/dev/null``): a FIFO or a socket would
    block or refuse the writer, a block device is no place for a report, ``/dev/full`` takes no byte."""
    import stat

    mode = os.stat(path).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return f"it is a {'FIFO' if stat.S_ISFIFO(mode) else 'socket'}; give a regular file"
    if not stat.S_ISCHR(mode):
        return "it is not a regular file"
    try:
        with open(path, "wb") as handle:
            handle.write(b"\0" * WritablePath.PROBE_BYTES)
            handle.flush()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


class RunIds(click.ParamType):
    """Comma-separated MLflow run ids (32 hexadecimal characters each), returned as a tuple."""

    name = "RUN_ID[,RUN_ID...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        ids = tuple(dict.fromkeys(item.strip() for item in str(value).split(",") if item.strip()))
        bad = [run_id for run_id in ids if len(run_id) != 32 or any(c not in "0123456789abcdef" for c in run_id)]
        if not ids or bad:
            self.fail(f"give MLflow run ids (32 hexadecimal characters) separated by commas (got '{value}')", param, ctx)
        return ids


class IntPair(click.ParamType):
    """Two whole numbers ``A,B`` (rows, columns), each at least ``minimum``, in the order given."""

    def __init__(self, what: str, example: str, minimum: int, metavar: str = "ROWS,COLS"):
        self.what, self.example, self.minimum = what, example, minimum
        self.name = metavar

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            numbers = tuple(int(item) for item in str(value).split(","))
        except ValueError:
            numbers = ()
        if len(numbers) != 2 or min(numbers) < self.minimum:
            self.fail(f"the {self.what} is two whole numbers of at least {self.minimum} separated by a comma, "
                      f"e.g. {self.example} (got '{value}')", param, ctx)
        return numbers


class FiniteFloat(click.FloatRange):
    """A real number in a range (click's ``FloatRange``) that is never NaN or infinite: NaN passes
    every comparison of a range check, and a NaN timeout or limit would silently never apply."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"must be a finite number (got '{value}')", param, ctx)
        return number


class NamedNumber(click.ParamType):
    """``NAME=VALUE`` with a finite number: ``(name, value)``."""

    name = "NAME=VALUE"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        name, _, number = str(value).partition("=")
        try:
            parsed = float(number)
        except ValueError:
            parsed = math.nan
        if not name.strip() or not math.isfinite(parsed):
            self.fail(f"expected NAME=VALUE with a finite number (e.g. min_idc=0.5), got '{value}'", param, ctx)
        return name.strip().replace("-", "_"), parsed


class Fraction(click.ParamType):
    """A fraction in [0, 1]."""

    name = "FRACTION"

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"must be a number between 0 and 1 (got '{value}')", param, ctx)
        if not 0 <= number <= 1:
            self.fail(f"is a fraction between 0 and 1 (got {value})", param, ctx)
        return number


class CheckedBy(click.ParamType):
    """A value an engine's own function checks (``checker``: ``"module:function"``, imported when first
    used, returning the normalised value); its UserError becomes click's one-line usage error."""

    checker = ""

    def convert(self, value, param, ctx):
        from mlflow_di.errors import UserError

        try:
            return pkgutil.resolve_name(self.checker)(value)
        except UserError as exc:
            self.fail(str(exc), param, ctx)


class DeviceSpec(CheckedBy):
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (checked here; whether CUDA exists is checked when used)."""

    name = "DEVICE"
    checker = "mlflow_di.models.device:check_device_spec"


class RayAddress(CheckedBy):
    """``local``, ``auto`` or ``[ray://]HOST:PORT`` (whether a cluster answers there is checked when used)."""

    name = "ADDRESS"
    checker = "mlflow_di._ray:check_address"


class CountOrPolicy(click.ParamType):
    """A count of 0 or more, or ``policy`` (also empty, as an MLproject's unset parameter): the policy's own."""

    name = "N|policy"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        if text in ("", "policy") or value is None:
            return None
        if not text.isdigit():
            self.fail(f"{text!r} is neither a count (0 or more) nor 'policy'", param, ctx)
        return int(text)


class RuntimeSpec(CheckedBy):
    """``NAME[:PRECISION]`` of a declared runtime that is installed here, e.g. ``openvino:f32``
    (:mod:`mlflow_di.models.runtimes`); a missing extra is the one-line refusal naming it."""

    name = "RUNTIME"
    checker = "mlflow_di.models.runtimes:installed_runtime"


class RuntimeName(CheckedBy):
    """``NAME[:PRECISION]`` of a declared runtime, installed here or not (the gate reads what others measured)."""

    name = "RUNTIME"
    checker = "mlflow_di.models.runtimes:named_runtime"


class RuntimeList(CheckedBy):
    """Comma-separated runtimes (``onnxruntime,openvino:f32``), each declared, installed and named once."""

    name = "RUNTIME,..."
    checker = "mlflow_di.models.runtimes:installed_runtimes"


def runtime_option(what: str):
    """``--runtime``: the declared runtime the exports run on (None: each format's own, ONNX Runtime for ONNX)."""
    from mlflow_di.models.runtimes import runtime_help

    return click.option("--runtime", type=RuntimeSpec(), default=None, help=f"{what}: {runtime_help()}.")


class AliasName(click.ParamType):
    """A registered model alias as MLflow accepts it (letters, digits, ``_`` and ``-``; at most 255
    characters; not ``latest`` nor a version name such as ``v3``), checked before anything is written."""

    name = "ALIAS"

    def convert(self, value, param, ctx):
        text = str(value)
        if not re.fullmatch(r"[\w\-]{1,255}", text) or text.lower() == "latest" or re.fullmatch(r"[vV]\d+", text):
            self.fail(f"{text!r} is not an alias MLflow accepts: letters, digits, '_' and '-' (at most 255), and "
                      "neither 'latest' nor a version name such as 'v3'", param, ctx)
        return text


class ModelName(click.ParamType):
    """A registered model name as MLflow keeps it: not empty, no control character, no ``/`` or ``:``,
    not ``.`` or ``..``; checked when the command line is read, so a bad name never costs a run."""

    name = "NAME"

    def convert(self, value, param, ctx):
        from mlflow_di.printable import name_problem, printable

        text = str(value)
        problem = name_problem(text, forbidden="/:") or ("it is a path step" if text in (".", "..") else None)
        if problem:
            self.fail(f"'{printable(text)}' cannot name a registered model: {problem} (use letters, digits, "
                      "'-', '_' and '.')", param, ctx)
        return text


class RealismBudget(CheckedBy):
    """``linf=LEVELS``, ``ssim=VALUE`` or both, e.g. ``linf=32,ssim=0.9``: a realism budget (a Constraint)."""

    name = "BUDGET"
    checker = "mlflow_di.fuzz.realism:parse_budget"


#: The parameter names :func:`ray_options` adds (a command's help can list them apart).
RAY_OPTIONS = ("workers", "ray_address", "cpus_per_worker", "gpus_per_worker")


def ray_options(what: str):
    """``--workers``, ``--ray-address``, ``--cpus-per-worker`` and ``--gpus-per-worker`` (``what``: the work spread)."""
    options = [
        click.option("--workers", type=click.IntRange(0), default=0, show_default=True,
                     help=f"Ray workers for {what}; 0 runs everything in this process (needs mlflow-di[ray] otherwise)."),
        click.option("--ray-address", type=RayAddress(), default="local", show_default=True,
                     help="local (start Ray on this machine), auto (the cluster this machine belongs to) or "
                          "ray://HOST:PORT."),
        click.option("--cpus-per-worker", type=FiniteFloat(0), default=1.0, show_default=True,
                     help="CPUs Ray reserves for each worker (fractions allowed)."),
        click.option("--gpus-per-worker", type=FiniteFloat(0), default=0.0, show_default=True,
                     help="GPUs Ray reserves for each worker (fractions share one GPU); PyTorch models then run there."),
    ]
    return stacked(options)


preprocessing_option = click.option(
    "--preprocessing", default=None, metavar="KEY=VALUE,...",
    help="Override the model's stored preprocessing, e.g. 'scale=1,layout=NHWC,input_shape=28/28/1'.")
json_out_option = click.option(
    "--json-out", type=WritablePath("file"), default=None, help="Also write the results to this JSON file.")
device_option = click.option(
    "--device", type=DeviceSpec(), default="auto", show_default=True,
    help="Where PyTorch models run: auto (CUDA when available), cpu, cuda or cuda:N.")
batch_size_option = click.option(
    "--batch-size", type=click.IntRange(1), default=256, show_default=True,
    help="Images per forward pass; lower it if the GPU runs out of memory.")
seed_option = click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
                           help="Seed of every random choice.")
