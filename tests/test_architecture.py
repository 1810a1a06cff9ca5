"""ARCHITECTURE.md's import rules, checked on every module's imports (top level and inside functions)."""
import ast
import re
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mlflow_di"
ENGINES = ("coverage", "fuzz", "compression", "repair", "inspection", "robustness", "reporting", "service")
FOUNDATIONS = ("models", "data.py", "deviation.py", "intervals.py", "results_json.py", "errors.py", "folder_lock.py",
               "gate.py", "policy.py",
               "progress.py", "registry.py", "settings.py", "extensions.py", "input_files.py", "printable.py",
               "processes.py",
               "_compat.py", "_ray.py")


def imports_of(path: pathlib.Path) -> set[str]:
    """Every module name ``path`` imports, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules(*parts: str) -> list[pathlib.Path]:
    found = []
    for part in parts:
        target = PACKAGE / part
        found.extend(sorted(target.rglob("*.py")) if target.is_dir() else [target])
    return found


def _uses(names: set[str], prefix: str) -> list[str]:
    return sorted(n for n in names if n == prefix or n.startswith(prefix + "."))


@pytest.mark.parametrize("path", modules(*ENGINES, *FOUNDATIONS), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_engines_and_foundations_never_import_mlflow_or_the_commands(path):
    names = imports_of(path)
    assert not _uses(names, "mlflow"), f"{path.name} imports MLflow; move that code to mlflow_di/mlflow_edge/"
    assert not _uses(names, "mlflow_di.commands") and not _uses(names, "mlflow_di.cli")
    allowed_edge = path == PACKAGE / "models" / "loading.py"  # fetches models:/ and runs:/ references
    if not allowed_edge:
        assert not _uses(names, "mlflow_di.mlflow_edge"), f"{path.name} reaches into the MLflow edge"


@pytest.mark.parametrize("path", modules(*FOUNDATIONS), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_foundations_never_import_the_engines(path):
    names = imports_of(path)
    above = [name for engine in ENGINES for name in _uses(names, f"mlflow_di.{engine}")]
    assert not above, f"{path.name} imports {above[0]}, a layer above it"


@pytest.mark.parametrize("path", modules("mlflow_edge"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_edge_never_imports_the_commands(path):
    names = imports_of(path)
    assert not _uses(names, "mlflow_di.commands") and not _uses(names, "mlflow_di.cli")


@pytest.mark.parametrize("path", modules("commands", "cli.py"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_commands_never_call_mlflow_directly(path):
    assert not _uses(imports_of(path), "mlflow"), f"{path.name} imports mlflow; go through mlflow_di.mlflow_edge"


@pytest.mark.parametrize("path", modules("coverage", "fuzz", "compression", "repair", "inspection", "robustness", "service"),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_engines_do_not_render_or_parse_options(path):
    names = imports_of(path)
    assert not _uses(names, "click") and not _uses(names, "mlflow_di.reporting")


def test_the_detector_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    import mlflow\n    from mlflow.exceptions import MlflowException\n")
    assert _uses(imports_of(sample), "mlflow") == ["mlflow", "mlflow.exceptions", "mlflow.exceptions.MlflowException"]


def test_help_imports_no_heavy_library():
    """`mlflow-di COMMAND --help` must answer at once: no torch, mlflow or onnxruntime behind it."""
    import subprocess
    import sys

    code = ("import sys; from mlflow_di.cli import main\n"
            "for cmd in ('demo','describe','import-keras','coverage','inspect','generate','compress','fuzz','repair',"
            "'robustness','gate','serve'):\n"
            "    try: main([cmd, '--help'])\n"
            "    except SystemExit: pass\n"
            "main(['coverage', '--clusters', '1'])\n"
            "print(sorted(m for m in ('torch', 'mlflow', 'onnxruntime', 'matplotlib') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-2000:] + result.stderr[-2000:]


def test_every_module_imports_with_warnings_as_errors():
    """Importing any module of the package, in any order, warns about nothing; in particular MLflow
    finds the ``mlflow_di`` dataset source through the entry point without a circular import."""
    import subprocess
    import sys

    script = ("import importlib, pkgutil, mlflow_di\n"
              "for m in sorted(pkgutil.walk_packages(mlflow_di.__path__, 'mlflow_di.'), key=lambda m: m.name):\n"
              "    importlib.import_module(m.name)\n"
              "from mlflow.data.dataset_source_registry import get_registered_sources\n"
              "assert 'SpecSource' in [s.__qualname__ for s in get_registered_sources()]\n")
    first = "import mlflow_di.mlflow_edge.spec_source\n"  # the entry point's module imported before MLflow
    done = subprocess.run([sys.executable, "-W", "error", "-c", first + script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (anywhere in the file, lazy imports
    included). ``from a.b import c`` depends on ``a.b.c`` when that is a module, else on ``a.b``."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        names[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name in names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(names)
                found |= submodules
                if node.module in names and len(submodules) < len(node.names):
                    found.add(node.module)
        graph[name] = found - {name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_import_circles_are_found():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_back_through_others():
    circles = import_circles(module_graph())
    assert circles == [], "import circles (lazy imports included): " + "; ".join(" <-> ".join(c) for c in circles)


#: The only imports from one engine into another: (importing engine, imported module). ARCHITECTURE.md
#: ("Which engine may use which") states each with its reason.
ENGINE_EDGES = {
    ("coverage", "mlflow_di.fuzz.mutations"), ("coverage", "mlflow_di.fuzz._random"),
    ("coverage", "mlflow_di.robustness.corruptions"),
    ("fuzz", "mlflow_di.coverage.activations"), ("fuzz", "mlflow_di.coverage.criteria_neuron"),
    ("compression", "mlflow_di.fuzz.runners"), ("compression", "mlflow_di.fuzz.contract"),
    ("compression", "mlflow_di.fuzz.strategies"), ("compression", "mlflow_di.fuzz.realism"),
    ("repair", "mlflow_di.fuzz.mutations"),
    ("inspection", "mlflow_di.coverage.activations"),
    ("reporting", "mlflow_di.fuzz.per_class"), ("reporting", "mlflow_di.fuzz.realism"), ("reporting", "mlflow_di.fuzz.results"),
    ("reporting", "mlflow_di.compression.blame"),
}


def test_engines_use_each_other_only_where_the_architecture_says():
    def engine(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 and parts[1] in ENGINES else None

    found = {(engine(module), imported) for module, imports in module_graph().items() if engine(module)
             for imported in imports if engine(imported) not in (None, engine(module))}
    assert found - ENGINE_EDGES == set(), "an engine uses another where ARCHITECTURE.md does not allow it"
    assert ENGINE_EDGES - found == set(), "an allowed edge is no longer used: drop it here and in ARCHITECTURE.md"
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    for engine, imported in ENGINE_EDGES:
        assert f"`{engine}` -> `{imported.removeprefix('mlflow_di.')}`" in text


def test_commands_parse_call_and_log_in_short_functions():
    """A command is parse -> load -> run -> log; each step a function of at most 60 lines (the work
    itself lives in the engines), and the fuzz command names no strategy (their declarations speak)."""
    long = []
    for path in modules("commands"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
    fuzz = (PACKAGE / "commands" / "fuzz.py").read_text().lower()
    from mlflow_di.fuzz.strategies import declarations

    assert [d.name for d in declarations() if re.search(rf"\b{re.escape(d.name)}\b", fuzz)] == []


def _code_strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal in ``path`` that is code, not a docstring."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_strategy_is_named_outside_its_engine_and_declarations():
    """Outside ``fuzz/`` (the commands, the policy, the MLflow edge, the bounded export's realism probe) the house
    reads a strategy's declaration and the declared defaults (``strategies.DEFAULT`` and ``REALISM``): a new
    strategy needs no edit there, and nothing picks one by name (a literal that is a strategy's name, or
    ``--strategy NAME`` in a message). Prose may still say "the boundary walk"."""
    from mlflow_di.fuzz.strategies import declarations

    names = {d.name for d in declarations()}
    named = [f"{path.relative_to(PACKAGE)}:{line} {text[:50]!r}"
             for path in sorted(PACKAGE.rglob("*.py")) if "fuzz" not in path.relative_to(PACKAGE).parts
             for line, text in _code_strings(path)
             if text.strip().lower() in names or set(re.findall(r"--strategy[ =]([a-z0-9-]+)", text.lower())) & names]
    assert named == []


def test_no_compression_method_is_named_outside_its_engine():
    """Outside ``compression/`` the house asks a method's declaration what it needs (``methods_that``), so a new
    method needs no edit elsewhere. The demo alone picks, by name, the methods it shows."""
    from mlflow_di.compression.declarations import METHODS

    names = set(METHODS)
    named = [f"{path.relative_to(PACKAGE)}:{line} {text[:50]!r}"
             for path in sorted(PACKAGE.rglob("*.py"))
             if "compression" not in path.relative_to(PACKAGE).parts and path.name != "demo.py"
             for line, text in _code_strings(path)
             if text.strip().lower() in names or set(re.findall(r"--method[ =]([a-z0-9-]+)", text.lower())) & names]
    assert named == []


def test_the_compress_command_names_no_method_even_in_its_help():
    """compress's options, help texts and checks come from the methods' declarations (their own options, which
    method calibrates, prunes or keeps layers in float): not one method name in the command's modules, so adding a
    method, or an option to one, is one edit in its declaration."""
    from mlflow_di.compression.declarations import METHODS

    pattern = re.compile("|".join(rf"(?<![\w-]){re.escape(name)}(?![\w-])" for name in METHODS))
    named = [f"{name}:{number} {line.strip()[:60]!r}" for name in ("compress.py", "method_options.py")
             for number, line in enumerate((PACKAGE / "commands" / name).read_text().splitlines(), 1)
             if pattern.search(line)]
    assert named == []


def test_the_strategy_contract_is_typed_not_probed():
    """Strategies are :class:`~mlflow_di.fuzz.contract.Strategy` protocols and their declarations say what they
    offer: nothing in the fuzz engine or the commands probes an object with ``hasattr``."""
    probing = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in modules("fuzz", "commands")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"]
    assert probing == []


def test_no_function_in_the_package_is_over_70_lines():
    """A function a reviewer reads on one screen (commands keep to 60, above)."""
    long = [f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 70]
    assert long == []


def test_the_compress_command_stays_under_400_lines():
    """A command parses options, calls engines and logs: compress's work lives in ``compression/`` (the
    export, its figures) and ``reporting/`` (its report and console lines), so the command reads whole."""
    lines = len((PACKAGE / "commands" / "compress.py").read_text().splitlines())
    assert lines < 400, f"commands/compress.py has {lines} lines; move a whole concept to an engine or reporting/"


def test_commands_ask_a_models_format_and_never_compare_its_name():
    """What a format can do lives on its :class:`ModelFormat` (graph, repairable, ...): a new format is one entry
    in FORMATS, not an edit in every command that branches on ``kind == "onnx"``."""
    from mlflow_di.models.formats import FORMATS

    names = set(FORMATS)
    compared = []
    for path in [*modules("commands"), PACKAGE / "models" / "origin.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "kind":
                values = [c for c in node.comparators if isinstance(c, (ast.Constant, ast.Tuple))]
                texts = {v.value for c in values for v in (c.elts if isinstance(c, ast.Tuple) else [c])
                         if isinstance(v, ast.Constant)}
                if texts & names:
                    compared.append(f"{path.name}:{node.lineno}")
    assert compared == []


def test_fuzz_help_keeps_each_strategys_and_rays_options_apart(capsys):
    from mlflow_di.cli import main

    assert main(["fuzz", "--help"]) == 0
    text = capsys.readouterr().out
    general, rest = text.split("DeepXplore options (only with --strategy deepxplore):")
    deepxplore, ray = rest.split("Ray options (--workers N):")
    assert "--dx-" not in general and "--workers" not in general and "--dx-" not in ray
    assert deepxplore.count("  --dx-") == 12 and "--ray-address" in ray
    assert len(text.splitlines()) <= 110  # two screens


def test_the_readme_fits_on_a_screen_and_its_links_resolve():
    """The README is the front door, read in a minute (under 110 lines); the guide lives in docs/ (built with
    `mkdocs build --strict` by `make test`). Every relative link of the README names a file."""
    import re

    readme = PACKAGE.parent / "README.md"
    text = readme.read_text()
    assert len(text.splitlines()) < 110
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if not t.startswith(("http", "#"))]
    assert targets and [t for t in targets if not (PACKAGE.parent / t).exists()] == []


#: a measured speed: "1.8 ms", "25-42 µs", "5x faster"; such figures belong in benchmarks/RESULTS.md
MEASURED_SPEED = re.compile(r"\b\d[\d.,]*(?:-\d[\d.,]*)? ?(?:ms|µs|us)\b|\b\d[\d.]*x (?:faster|slower)\b")


def _comments_and_docstrings(source: str):
    import io
    import tokenize

    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.string.startswith(('"""', "'''"))):
            yield token.start[0], token.string


def test_comments_say_why_and_leave_measured_speeds_to_the_results():
    quoting = [f"{path.relative_to(PACKAGE.parent)}:{line}: {found.group(0)}"
               for path in sorted(PACKAGE.rglob("*.py"))
               for line, text in _comments_and_docstrings(path.read_text())
               for found in [MEASURED_SPEED.search(text)] if found]
    assert not quoting, "figures that belong in benchmarks/RESULTS.md:\n" + "\n".join(quoting)
    assert MEASURED_SPEED.search("# took 1.8 ms per image") and MEASURED_SPEED.search('"""5x faster"""')


def _is_click_command(node) -> bool:
    return any("click" in ast.unparse(d) or "option" in ast.unparse(d) for d in node.decorator_list)


def _parameters(node) -> int:
    """What a caller can pass (self and cls not counted)."""
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    skip = 1 if a.args and a.args[0].arg in ("self", "cls") else 0
    return len(names) - skip + bool(a.vararg) + bool(a.kwarg)


def test_functions_take_at_most_ten_parameters_and_calls_name_what_they_pass():
    """Values between steps are records, not long argument lists: no function outside the click commands takes
    more than 10 parameters, and no call passes more than 6 arguments by position (the rest by name). The
    scikit-learn estimators' constructors are the exception scikit-learn's own contract makes: get_params and
    clone read every hyperparameter from the signature (no **kwargs), as its own estimators' do."""
    tree_of = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    estimators = {node.name for tree in tree_of.values() for node in ast.walk(tree)
                  if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "BaseEstimator" for b in node.bases)}
    variadic = {"zip", "print", "max", "min"} | {node.name for tree in tree_of.values() for node in ast.walk(tree)
                                                   if isinstance(node, ast.FunctionDef) and node.args.vararg}
    long, positional = [], []
    for path, tree in tree_of.items():
        for cls in [None, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            body = tree.body if cls is None else cls.body
            for node in body:
                if isinstance(node, ast.FunctionDef) and _parameters(node) > 10 and not _is_click_command(node) \
                        and not (cls is not None and cls.name in estimators and node.name == "__init__"):
                    long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({_parameters(node)})")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.col_offset and not any(
                    node in getattr(parent, "body", ()) for parent in ast.walk(tree) if isinstance(parent, ast.ClassDef)):
                if _parameters(node) > 10:  # a nested function
                    long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({_parameters(node)})")
            if isinstance(node, ast.Call) and len(node.args) > 6:
                callee = ast.unparse(node.func).rsplit(".", 1)[-1]
                if callee not in variadic:
                    positional.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {callee} ({len(node.args)})")
    assert long == [], "functions of more than 10 parameters: pass a record"
    assert positional == [], "calls passing more than 6 arguments by position: name them"
