"""``mlflow-di pipeline``: run what a policy declares for a registered model, as linked runs.

The policy (:mod:`mlflow_di.policy`) names the exports to make, the coverage data and settings,
the fuzzing budget, robustness (optional) and the gate's thresholds and alias. Each step is the
command a user would run (``compress``, ``coverage``, ``fuzz`` with every export at once,
``robustness``, ``gate``), invoked in process; their runs are children of one ``pipeline`` run.

Resumable: a state file (JSON, written atomically after each step) records the finished steps
and their outputs. Run again with the same policy (same bytes) and model, the finished steps are
skipped and an interrupted fuzz campaign continues (``fuzz --resume`` on the folder it recorded);
a changed policy starts over. The steps load a pickled PyTorch model only when the policy trusts
its registered model (``trust.pickled_models``): nobody chose the version a service hands over.

Evidence as large as the decision needs: with the policy's ``evidence.rounds`` above 1, a gate
that finds a fuzz or realism check INCONCLUSIVE sends that step back to its campaign with
``evidence.growth`` times the seeds (the campaign extended, never restarted, up to every image of
its seed data) and looks again, until every check is decided or the rounds are spent; those steps'
intervals are made at confidence 1 - 0.05/rounds so that looking more than once keeps the stated
error. A check that more seeds cannot decide (coverage, compression on fixed data) is said so.

The pipeline's run gets the gate's verdict tag, metrics and report. Exit code: the gate's (0 PASS,
1 FAIL, 3 INCONCLUSIVE), 2 when the version could not be analysed (a step's bad input, or a gate
with nothing to judge); the version is then tagged ``mlflow_di.verdict=ERROR`` with the one-line
cause at the top of its description, so it never reads as a quality failure.
"""
from __future__ import annotations

import json
import pathlib
import re
import time

import click

from mlflow_di.commands.options import CountOrPolicy, RayAddress, WritablePath
from mlflow_di.commands.output_files import write_text_out

PIPELINES = pathlib.Path("mlflow-di-pipelines")
STATE_FILE = "state.json"


@click.command("pipeline")
@click.option("--policy", "policy_path", required=True, type=click.Path(dir_okay=False),
              help="The policy YAML file (see examples/policies/demo.yaml).")
@click.option("--model-uri", required=True, metavar="models:/NAME/VERSION", help="The registered version to test.")
@click.option("--state-dir", type=WritablePath("dir"), default=None,
              help="Where the pipeline keeps its state and fuzz campaign (default: mlflow-di-pipelines/<model>/).")
@click.option("--restart", type=click.BOOL, is_flag=False, flag_value=True, default=False, metavar="[BOOL]",
              help="Ignore the recorded state and run every step again (also --restart true, as `mlflow run -P "
                   "restart=true` passes it).")
@click.option("--workers", type=CountOrPolicy(), default=None,
              help="Ray workers for the fuzz, realism and coverage steps, instead of the policy's ray.workers (0: "
                   "none); the records are the same either way.")
@click.option("--ray-address", type=RayAddress(), default=None,
              help="The Ray cluster for those workers, instead of the policy's ray.address (default local).")
@click.pass_context
def command(ctx: click.Context, policy_path: str, model_uri: str, state_dir: str | None, restart: bool,
            workers: int | None = None, ray_address: str | None = None) -> None:
    """Run the steps POLICY declares on MODEL-URI (compress, coverage, fuzz, robustness, gate) as child runs of one run."""
    from mlflow_di.errors import UserError
    from mlflow_di.policy import load_policy

    policy = _with_ray(load_policy(policy_path), workers, ray_address)
    steps = _step_arguments(ctx, policy, model_uri)  # every value checked before any run starts
    folder = pathlib.Path(state_dir) if state_dir else PIPELINES / _slug(model_uri)
    state = _state(folder, policy, model_uri, restart)
    if all(step in state["done"] for step in policy.steps):
        gate = state["done"]["gate"]
        note = f"every step already finished (state {folder / STATE_FILE}); pass --restart to run them again"
        click.echo(note)
        click.echo(f"verdict {gate.get('outcome', '?')} (gate run {gate.get('run_id') or '-'}, pipeline run "
                   f"{state.get('run_id') or '-'})")
        _where_to_look(model_uri)
        _note_in_project_run(note, gate)
        if gate.get("outcome") == "ERROR":
            raise UserError(gate["error"])
        _exit(ctx, gate["exit_code"])
        return
    with _one_pipeline_per_version(model_uri):  # a second one refuses (exit 75): two would write two verdicts
        log, gate = _run_steps(ctx, policy, policy_path, model_uri=model_uri, steps=steps, state=state, folder=folder)
    click.echo("")
    click.echo(f"pipeline run {log.run_id}: verdict {gate['outcome']}; state {folder / STATE_FILE}")
    _where_to_look(model_uri)
    if gate["outcome"] == "ERROR":
        raise UserError(gate["error"])
    _exit(ctx, gate["exit_code"])


def _note_in_project_run(note: str, gate: dict) -> None:
    """Under ``mlflow run`` (its run already exists): say in that run that nothing ran, and which verdict stands."""
    import os

    if not os.environ.get("MLFLOW_RUN_ID"):
        return  # on the command line the console line says it, and no run is made
    from mlflow_di.mlflow_edge import runs

    with runs.tracked_run(f"pipeline: verdict {gate.get('outcome', '?')} (nothing left to do)", tags={
            "mlflow_di.command": "pipeline", "mlflow_di.note": note, "mlflow_di.verdict": gate.get("outcome", "?"),
            "mlflow_di.gate_run_id": gate.get("run_id") or "-"}):
        pass


def _one_pipeline_per_version(model_uri: str):
    """The registry version's lock (:mod:`mlflow_di.mlflow_edge.version_lock`), held for the whole pipeline."""
    import contextlib

    from mlflow_di.mlflow_edge import registry
    from mlflow_di.mlflow_edge.version_lock import version_lock

    if registry.registry_ref(model_uri) is None:
        return contextlib.nullcontext()
    version = registry.resolve_version(model_uri)
    return version_lock(version.name, version.version, "pipeline")


def _run_steps(ctx: click.Context, policy, policy_path: str, model_uri: str, steps: dict, state: dict,
               folder: pathlib.Path):
    """Every step not finished yet, as child runs of the pipeline's run; (its run, the gate's record)."""
    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge import runs
    from mlflow_di.mlflow_edge.version_lock import record_holder_run
    from mlflow_di.models.loading import only_trusted_pickles

    tags = {"mlflow_di.command": "pipeline", "mlflow_di.pipeline_state": str((folder / STATE_FILE).resolve())}
    try:
        with runs.tracked_run(f"pipeline {model_uri}", tags=tags, run_id=state.get("run_id")) as log:
            log.params({"policy": str(policy_path), "policy_sha256": policy.sha256, "model_uri": model_uri})
            log.text(pathlib.Path(policy_path).read_text(), "pipeline/policy.yaml")
            state["run_id"] = log.run_id
            record_holder_run(log.run_id)  # a pipeline killed from here on: whoever takes its lock over ends its runs
            _save(folder, state)
            for number, step in enumerate(policy.steps, 1):
                title = f"{number}/{len(policy.steps)} {step}"
                if step in state["done"]:
                    _banner(f"{title}: finished earlier, skipped")
                    continue
                _banner(f"{title}: {_describe(step, steps[step], state)}")
                with only_trusted_pickles(policy.trusted_pickles, f"the policy {policy.source}"):
                    state["done"][step] = _run_step(ctx, step, _grown(steps[step], step, state), state, folder,
                                                    steps["gate"].get("realism_budget"))
                _save(folder, state)
            while _more_evidence(policy, steps, state, folder):
                for step in (s for s in policy.steps if s not in state["done"]):
                    _banner(f"round {state['round']}/{policy.evidence.rounds} {step}: "
                            f"{_describe(step, _grown(steps[step], step, state), state)}")
                    with only_trusted_pickles(policy.trusted_pickles, f"the policy {policy.source}"):
                        state["done"][step] = _run_step(ctx, step, _grown(steps[step], step, state), state, folder,
                                                        steps["gate"].get("realism_budget"))
                    _save(folder, state)
            gate = state["done"]["gate"]
            _log_gate(log, gate, ctx.meta.get("mlflow_di.gate"))
    except UserError as exc:  # a step could not analyse the version: ERROR on it, not a quality failure
        if getattr(exc, "exit_code", 2) == 2:
            _record_error(model_uri, str(exc))
        raise
    return log, gate


#: the gate checks that more fuzz seeds can decide, and the step whose campaign measures each
GROWABLE = {"success_rate": "fuzz", "mean_queries": "fuzz", "realistic_success_rate": "realism"}


def _grown(arguments: dict, step: str, state: dict) -> dict:
    """A step's arguments in the current round: a fuzz step's seeds as grown so far (``state["num_seeds"]``)."""
    grown = state.get("num_seeds", {}).get(step)
    return {**arguments, "num_seeds": grown} if grown else arguments


def _more_evidence(policy, steps: dict, state: dict, folder: pathlib.Path) -> bool:
    """After a gate: whether another round runs. It does when the verdict is INCONCLUSIVE, rounds are left, and an
    inconclusive check's fuzz step has seed images left: that step's seeds grow by ``evidence.growth`` and it is
    marked to run again with the gate (its campaign is extended). Says why when no more evidence can be had."""
    from mlflow_di.data import load_images

    gate = state["done"].get("gate", {})
    rounds = policy.evidence.rounds
    state.setdefault("round", 1)
    undecided = gate.get("inconclusive") or []
    if gate.get("outcome") != "INCONCLUSIVE" or not undecided:
        return False
    fixed = sorted({c["label"] for c in undecided if GROWABLE.get(c["metric"]) not in steps})
    grow: dict[str, int] = {}
    for step in sorted({GROWABLE[c["metric"]] for c in undecided if GROWABLE.get(c["metric"]) in steps}):
        current = _grown(steps[step], step, state)["num_seeds"]
        available = len(load_images(steps[step]["seed_data"]))
        if current < available:
            grow[step] = min(current * policy.evidence.growth, available)
        else:
            fixed.append(f"{step} (all {available} images of {steps[step]['seed_data']} already fuzzed)")
    if state["round"] >= rounds or not grow:
        why = (f"{rounds} round{'s' if rounds > 1 else ''} of evidence spent (evidence.rounds)" if grow else
               "no step can gather more evidence for " + ", ".join(fixed or ["them"]))
        click.echo(f"INCONCLUSIVE after round {state['round']}: {why}")
        return False
    state["round"] += 1
    for step, seeds in grow.items():
        click.echo(f"round {state['round']}/{rounds}: {step} grows to {seeds} seeds (was "
                   f"{_grown(steps[step], step, state)['num_seeds']}) for its inconclusive checks")
        state.setdefault("num_seeds", {})[step] = seeds
        state["done"].pop(step, None)
    state["done"].pop("gate", None)
    _save(folder, state)
    return True


def _where_to_look(model_uri: str) -> None:
    """Where the verdict and the evidence are in the MLflow UI (the run's own line follows at exit)."""
    from mlflow_di.mlflow_edge.runs import ui_line

    click.echo("where to look:")
    click.echo(f"  {ui_line()}")
    name, _, version = model_uri.removeprefix("models:/").partition("/")
    page = f"Models > {name} > Version {version}" if model_uri.startswith("models:/") and version.isdigit() \
        else f"Models > {name}"
    click.echo(f"  {page}: the verdict heads the version's description")
    click.echo("  the pipeline run below: gate/report.html in its Artifacts; one child run per step with its report")


def _log_gate(log, gate: dict, this_process: dict | None) -> None:
    """The gate's verdict on the pipeline's own run: its tag, its metrics and its report (when the
    gate ran in this process; a resumed pipeline whose gate finished earlier logged them then)."""
    log.tags({"mlflow_di.verdict": gate["outcome"], "mlflow_di.gate_run_id": gate.get("run_id") or "-"})
    if this_process:
        log.metrics(this_process["metrics"])
        log.text(this_process["report"], "gate/report.html")


def _record_error(model_uri: str, cause: str) -> None:
    """Write verdict ERROR and its one-line cause on the registry version, where it can be written."""
    from mlflow_di.mlflow_edge import registry
    from mlflow_di.reporting.ci import error_markdown

    if registry.registry_ref(model_uri) is None:
        return
    try:
        version = registry.resolve_version(model_uri)
        registry.write_version_tags(version, {"mlflow_di.verdict": "ERROR"})
        registry.write_verdict_description(version, error_markdown(model_uri, cause))
    except Exception:  # noqa: BLE001 - the registry may be the very thing that failed; the error line says why
        pass


def _exit(ctx: click.Context, code: int) -> None:
    if code:
        ctx.exit(code)


def _banner(title: str) -> None:
    click.echo("")
    click.secho(f"== {title}", bold=True)


def _slug(model_uri: str) -> str:
    """The default state folder's name: the URI's safe characters and a hash of the whole URI, so that models whose
    names differ only in the replaced characters ("col a", "col_a") never share a state."""
    import hashlib

    safe = re.sub(r"[^A-Za-z0-9.@-]+", "_", model_uri).strip("_")[-110:] or "model"
    return f"{safe}-{hashlib.sha256(model_uri.encode()).hexdigest()[:8]}"


# ---------------------------------------------------------------------------------------------- state

def _state(folder: pathlib.Path, policy, model_uri: str, restart: bool) -> dict:
    """The recorded state when it belongs to this policy and model, else a fresh one (saying why)."""
    fresh = {"policy_sha256": policy.sha256, "model_uri": model_uri, "done": {}}
    path = folder / STATE_FILE
    if restart or not path.exists():
        return fresh
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        click.echo(f"cannot read the state {path} ({exc}); starting over")
        return fresh
    if state.get("policy_sha256") != policy.sha256 or state.get("model_uri") != model_uri:
        what = "the policy changed" if state.get("model_uri") == model_uri else f"it was {state.get('model_uri')}'s"
        click.echo(f"state {path} does not match ({what}); starting over")
        return fresh
    if state.get("done"):
        click.echo(f"resuming from {path}: {', '.join(state['done'])} finished earlier")
    state.setdefault("done", {})
    return state


def _save(folder: pathlib.Path, state: dict) -> None:
    write_text_out(json.dumps(state, indent=2, sort_keys=True), str(folder / STATE_FILE))


# ---------------------------------------------------------------------------------------------- steps

def _with_ray(policy, workers: int | None, address: str | None):
    """``policy`` with the command line's Ray settings in place of its ``ray`` section's (None: the policy's). The
    policy's fingerprint stays: where the work runs does not change what it records."""
    import dataclasses

    ray = policy.ray
    if workers is not None:
        ray = dataclasses.replace(ray, workers=workers)
    if address is not None:
        ray = dataclasses.replace(ray, address=address)
    return dataclasses.replace(policy, ray=ray)


def _step_arguments(ctx: click.Context, policy, model_uri: str) -> dict[str, dict]:
    """{step: the keyword arguments of its command}, each policy value converted and checked by the
    command's own option type (a bad one is a UserError naming the policy key)."""
    from mlflow_di.commands import compress, coverage, fuzz, gate, robustness

    commands = {"compress": compress.command, "coverage": coverage.command, "fuzz": fuzz.command,
                "realism": fuzz.command, "robustness": robustness.command, "gate": gate.command}
    if policy.compress is not None:
        _check_method_option_keys(policy.compress, policy.source)
    steps = {}
    for step in policy.steps:
        section = policy.to_dict()[step]
        if step == "gate":
            section = {**section.pop("thresholds"), **section}
        if step in ("coverage", "fuzz", "realism"):  # the policy's Ray settings, as the step's own options
            section = {**section, **policy.ray.arguments(step)}
        steps[step] = _converted(ctx, commands[step], section, f"{policy.source}: {step}")
    override = policy.preprocessing_of(_registered_name(model_uri))
    if override:  # the policy's preprocessing for this model, as each step's own option
        for step, key in (("compress", "preprocessing"), ("coverage", "preprocessing"),
                          ("fuzz", "preprocessing_original"), ("realism", "preprocessing_original"),
                          ("robustness", "preprocessing")):
            if step in steps:
                steps[step][key] = override
    from mlflow_di.fuzz import strategies
    from mlflow_di.fuzz.contract import REALISM_SEEDS

    seeds = {"fuzz": _default(fuzz.command, "num_seeds"), "realism": REALISM_SEEDS}
    for step, default in (("fuzz", strategies.DEFAULT), ("realism", strategies.REALISM)):
        if step in steps:  # the policy left it out: the declared default
            steps[step].setdefault("strategy", default)
            steps[step].setdefault("num_seeds", seeds[step])  # what each round's growth starts from
            steps[step]["confidence"] = policy.evidence.confidence  # growing evidence is looked at up to rounds times
    _check_strategies_take_exports(steps, policy.source)
    if policy.compress is not None:
        _check_methods_take_the_policy(policy.compress, policy.source)
    return steps


def _check_method_option_keys(compress, source: str) -> None:
    """A one-line UserError for a compress key that is neither the section's own nor a declared method's option
    (before the values are converted by those options)."""
    import dataclasses

    from mlflow_di.compression.declarations import method_options
    from mlflow_di.errors import UserError
    from mlflow_di.policy import CompressPolicy

    declared = method_options()
    for key in compress.method_options:
        if key not in declared:
            known = [field.name for field in dataclasses.fields(CompressPolicy) if field.name != "method_options"]
            raise UserError(f"{source}: unknown key compress.{key}; known: {', '.join([*known, *declared])}")


def _check_methods_take_the_policy(compress, source: str) -> None:
    """What the compression methods' declarations need of the compress section, before any step: calibration
    data for a method that calibrates, and a selective method for the bounds (one line naming the key)."""
    from mlflow_di.compression.declarations import methods_that
    from mlflow_di.errors import UserError

    calibrated = methods_that("needs_calibration", compress.methods)
    if calibrated and not compress.calib_data:
        raise UserError(f"{source}: compress.calib_data is required for {calibrated[0]}")
    if compress.bounded and not methods_that("selective", compress.methods):
        selective = " or ".join(methods_that("selective"))
        raise UserError(f"{source}: compress.max_accuracy_drop, max_disagreement_rate and max_realistic_success_rate "
                        f"bound the {selective} export; add {selective} to compress.methods")


def _check_strategies_take_exports(steps: dict, source: str) -> None:
    """The pipeline fuzzes the model against its ONNX exports, as black boxes: a strategy whose declaration needs
    a white-box compressed model cannot run there (one line before any step)."""
    from mlflow_di.errors import UserError
    from mlflow_di.fuzz.contract import Access
    from mlflow_di.fuzz.strategies import declarations

    white_box = {d.name for d in declarations() if d.compressed is Access.WHITE_BOX}
    black_box = ", ".join(d.name for d in declarations() if d.compressed is Access.BLACK_BOX)
    for step in ("fuzz", "realism"):
        strategy = steps.get(step, {}).get("strategy")
        if strategy in white_box:
            raise UserError(f"{source}: {step}.strategy {strategy} needs PyTorch models on both sides, and the pipeline "
                            f"fuzzes the model against its ONNX exports; choose one of {black_box}")


def _registered_name(model_uri: str) -> str | None:
    from mlflow_di.models.reference import ModelRef, RefKind

    ref = ModelRef.parse(model_uri)
    return ref.name if ref.kind is RefKind.REGISTRY else None


def _default(command: click.Command, name: str):
    """The default of ``command``'s option ``name``: what a step gets for a key its policy leaves out."""
    return next(param.default for param in command.params if param.name == name)


def _converted(ctx: click.Context, command: click.Command, values: dict, where: str) -> dict:
    from mlflow_di.errors import UserError

    params = {param.name: param for param in command.params}
    kwargs = {}
    for key, value in values.items():
        if value is None:
            continue
        param = params[key]
        if isinstance(value, dict):  # a mapping of settings: the option's repeated FIELD=VALUE form
            value = [f"{field}={item}" for field, item in value.items()]
        if isinstance(value, list) and not param.multiple:
            value = ",".join(str(item) for item in value)  # the option's comma-separated form
        try:
            kwargs[key] = param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise UserError(f"{where}.{key}: {exc.message}") from None
    return kwargs


def _describe(step: str, arguments: dict, state: dict) -> str:
    if step == "compress":
        return ", ".join(arguments["methods"])
    if step == "coverage":
        return ", ".join(arguments.get("criteria") or ("IDC and the classic criteria",))
    if step in ("fuzz", "realism"):
        return f"{arguments['strategy']} against {', '.join(_exports(state)) or 'no export'}"
    if step == "robustness":
        return f"on {arguments['data']}"
    return ", ".join(f"{key.replace('_', '-')} {value:g}" for key, value in arguments.items() if isinstance(value, float))


def _exports(state: dict) -> list[str]:
    return state["done"].get("compress", {}).get("exports", [])


def _inside_the_gates_budget(arguments: dict, budget) -> dict:
    """The realism step's fuzz arguments: the budget it names, else the gate's realism budget (``budget``, a
    Constraint or None for the default), its SSIM bound left out on seeds too small for SSIM's window."""
    from mlflow_di.data import load_images
    from mlflow_di.fuzz.realism import DEFAULT_BUDGET, SSIM_RADIUS

    if arguments.get("max_linf") is not None or arguments.get("min_ssim") is not None:
        return arguments
    budget = budget or DEFAULT_BUDGET
    measurable = min(load_images(arguments["seed_data"]).image_shape[:2]) > 2 * SSIM_RADIUS
    return {**arguments, "max_linf": budget.max_linf, "min_ssim": budget.min_ssim if measurable else None}


def _run_step(ctx: click.Context, step: str, arguments: dict, state: dict, folder: pathlib.Path,
              gate_budget=None) -> dict:
    """Run ``step``; returns what the state records for it (``gate_budget``: the gate's realism budget, which
    the realism step searches inside unless its section names one)."""
    from mlflow_di.commands import compress, coverage, fuzz, gate, robustness
    from mlflow_di.errors import UserError

    model_uri = state["model_uri"]
    finished = {"finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if step == "compress":
        return {**finished, "exports": list(ctx.invoke(compress.command, model_uri=model_uri, **arguments))}
    if step == "coverage":
        ctx.invoke(coverage.command, model_uri=model_uri, **arguments)
        return finished
    if step in ("fuzz", "realism"):
        key = "fuzz_campaign" if step == "fuzz" else "realism_campaign"
        campaign = state.setdefault(key, str(folder / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"))
        _save(folder, state)  # recorded before it starts: a crash resumes this folder
        resume = pathlib.Path(campaign).is_dir() and any(pathlib.Path(campaign).iterdir())
        if resume:
            click.echo(f"resuming the campaign in {campaign}")
        if step == "realism":
            arguments = _inside_the_gates_budget(arguments, gate_budget)
        ctx.invoke(fuzz.command, original=model_uri, compressed=tuple(_exports(state)), out_dir=campaign,
                   resume=resume, **arguments)
        return {**finished, "campaign": campaign}
    if step == "robustness":
        ctx.invoke(robustness.command, model_uri=model_uri, compressed=tuple(_exports(state)), **arguments)
        return finished
    from mlflow_di.mlflow_edge import runs

    ctx.meta.pop("mlflow_di.gate", None)
    ctx.meta[gate.PIPELINE_RUN] = state["run_id"]  # how the verdict names its evidence
    evidence = tuple(runs.descendant_run_ids(state["run_id"]))  # this pipeline's own step runs, nothing newer
    try:
        ctx.invoke(gate.command, model_uri=model_uri, compressed=tuple(_exports(state)), pinned_runs=evidence,
                   **arguments)
        code, error = 0, ""
    except click.exceptions.Exit as stop:
        code, error = stop.exit_code, ""
    except UserError as exc:
        if "mlflow_di.gate" not in ctx.meta:  # bad input before any verdict: the pipeline's own error
            raise
        code, error = 2, str(exc)
    judged = ctx.meta["mlflow_di.gate"]
    return {**finished, "exit_code": code, "outcome": judged["outcome"], "run_id": judged["run_id"], "error": error,
            "inconclusive": judged.get("inconclusive", [])}
