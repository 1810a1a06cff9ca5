"""``mlflow-di serve``: run the pipeline for every new registered model version, as a service.

New versions arrive two ways: MLflow 3 registry webhooks (``model_version.created``, POSTed to
``/webhook``, signed with a secret read from an environment variable) and, for stores without
webhooks or for what happened while the service was down, polling (``--poll-seconds``). On its
first start the service records the time in its state folder; only versions created after it
are jobs, unless ``--backfill`` enqueues the existing ones too. Versions mlflow-di registered
itself (exports) are never jobs.

Jobs live in a sqlite queue in the state folder (:mod:`mlflow_di.service.queue`): one per version,
ever; ``--workers`` run at a time, each job's pipeline in a subprocess with its own state folder,
retried with backoff when it crashes; with ``--ray-address``, each in an actor on a Ray cluster
(:mod:`mlflow_di.service.ray_jobs`) while the queue, the registry and the webhooks stay here. Each
transition is one log line and the version's ``mlflow_di.status`` tag (queued, running, passed,
failed, inconclusive, error). A pickled PyTorch version is loaded only when the policy trusts its
registered model (``trust.pickled_models``): loading a pickle runs its code, and nobody chose the
versions a service is handed.

Stopping (Ctrl-C, SIGTERM): the endpoints close, running pipelines are terminated and their jobs
stay ``running``; the next start puts them back in the queue and the pipeline resumes from its
state file. A killed service (SIGKILL) is handled the same way at the next start, after any
pipeline it left behind is stopped. Exit code 0 when stopped, 2 on bad input at start (before
any port is bound). Not an MLproject entry point: ``mlflow run`` is for jobs that end.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import sys
import threading
import time

import click

from mlflow_di.commands.options import FiniteFloat, RayAddress, WritablePath

DEFAULT_STATE = "mlflow-di-service"
DEFAULT_PORT = 5055
WEBHOOK_NAME = "mlflow-di-serve"  # MLflow allows letters, digits, . _ - only
#: Seconds before a failed tag write is tried again (the registry may be down for a while).
TAG_RETRY_S = 30.0
#: With webhooks and --poll-seconds 0, the registry is still read (reconciled) at start, once again after
#: this many seconds (a tracking server caches its webhook list for MLFLOW_WEBHOOK_CACHE_TTL, 60 s by
#: default, so a version created just after the webhook was registered is delivered to no one) ...
RECONCILE_AFTER_START_S = 90.0
#: ... and then this often, for a delivery lost for any other reason (the service restarting, a network error)
RECONCILE_S = 600.0


@click.command("serve")
@click.option("--policy", "policy_path", required=True, type=click.Path(dir_okay=False),
              help="The pipeline policy for every version (checked at start; see examples/policies/demo.yaml).")
@click.option("--state-dir", type=WritablePath("dir"), default=DEFAULT_STATE, show_default=True,
              help="The queue (jobs.sqlite), each job's pipeline state and log.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the endpoints bind to (0.0.0.0 exposes them to the network).")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="Port of /health, /jobs and POST /webhook (0: any free port, printed at start).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Pipelines run at the same time (default: one per CPU core; with --ray-address, as many as the "
                   "cluster's CPUs hold); each pipeline's models get the cores divided by the workers as threads, so "
                   "the machine is used without oversubscribing it.")
@click.option("--ray-address", type=RayAddress(), default=None,
              help="Run each job's pipeline in an actor on this Ray cluster (auto, HOST:PORT or ray://HOST:PORT) "
                   "instead of a subprocess here; the actor reserves the policy's ray resources (see "
                   "docs/how-to/ray.md). The queue, the registry and the webhooks stay with the service.")
@click.option("--poll-seconds", type=FiniteFloat(min=0), default=60.0, show_default=True,
              help="Look for new versions this often (0: with webhooks, only a reconciling look at start, 90 s "
                   "later and every 10 minutes, for what a webhook missed).")
@click.option("--model", "models", multiple=True, metavar="NAME",
              help="Only versions of this registered model (repeatable; default: every model).")
@click.option("--backfill", is_flag=True,
              help="Also queue the versions that existed before the service first started.")
@click.option("--max-attempts", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs of a pipeline that crashes before its job is an error.")
@click.option("--retry-backoff", type=FiniteFloat(min=0), default=30.0, show_default=True,
              help="Seconds before the first retry; doubled for each further one.")
@click.option("--webhook-secret-env", metavar="VAR", default=None,
              help="Environment variable holding the webhook secret; POST /webhook is refused without it.")
@click.option("--register-webhook", metavar="URL", default=None,
              help="Register (or update) the registry webhook sending model_version.created to URL at start.")
def command(policy_path, state_dir, host, port, workers, ray_address, poll_seconds, models, backfill, max_attempts,
            retry_backoff, webhook_secret_env, register_webhook) -> None:
    """Run the pipeline POLICY declares for every new model version (webhooks and/or polling)."""
    from mlflow_di.errors import UserError
    from mlflow_di.policy import load_policy

    policy = load_policy(policy_path)  # one line naming the file and the key; nothing bound yet
    _check_steps(policy)
    secret = _secret(webhook_secret_env)
    if register_webhook is not None:
        if not re.match(r"https?://[^/\s]+", register_webhook):
            raise UserError(f"--register-webhook: '{register_webhook}' is not an http(s):// URL")
        if secret is None:
            raise UserError("--register-webhook needs --webhook-secret-env VAR: deliveries are signed with that secret")
    if poll_seconds == 0 and secret is None:
        raise UserError("--poll-seconds 0 with no --webhook-secret-env: nothing would ever bring a job")
    untrusted = sorted(set(models) - set(policy.trusted_pickles))
    if not policy.trusted_pickles or untrusted:
        click.echo(f"note: {policy.source} trusts no pickled model"
                   + (f" of {', '.join(untrusted)}" if models and policy.trusted_pickles else "")
                   + ": versions logged as pickled PyTorch models will end in error (list their registered models "
                   "under trust.pickled_models); pt2 (MLflow's default for PyTorch), ONNX and TFLite versions run")
    service = Service(pathlib.Path(state_dir), policy_path, models, workers=workers, max_attempts=max_attempts,
                      backoff_s=retry_backoff, secret=secret, poll_seconds=poll_seconds, backfill=backfill,
                      ray_address=ray_address)
    service.start(host, port, register_webhook)
    service.wait()


def poll_due_after(elapsed: float, poll_seconds: float) -> float:
    """Seconds after the start when the registry is next read, ``elapsed`` seconds after the start:
    every ``poll_seconds``; with 0 (webhooks bring the jobs), :data:`RECONCILE_AFTER_START_S` after
    the start, then every :data:`RECONCILE_S`."""
    if poll_seconds:
        return elapsed + poll_seconds
    if elapsed < RECONCILE_AFTER_START_S:
        return RECONCILE_AFTER_START_S
    return elapsed + RECONCILE_S


def _vanished(job) -> bool:
    """Whether the job's version is gone from the registry (False when the registry cannot say)."""
    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge import watch

    try:
        watch.created_ms(job.model, job.version)
    except watch.VersionAbsent:
        return True
    except UserError:
        return False
    return False


def _check_steps(policy) -> None:
    """The policy's values the step commands check (method names, strategy, ...), at start."""
    from mlflow_di.commands import pipeline

    with click.Context(pipeline.command) as ctx:
        pipeline._step_arguments(ctx, policy, "models:/model/1")


def _secret(variable: str | None) -> str | None:
    from mlflow_di.errors import UserError

    if variable is None:
        return None
    value = os.environ.get(variable)
    if not value or not value.strip():
        raise UserError(f"--webhook-secret-env: the environment variable {variable} is not set (or empty, or only "
                        "whitespace); export the webhook secret in it")
    return value


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _slug(text: str) -> str:
    """A folder or file name for ``text``: its safe characters, and a hash of it where any were replaced, so that
    names that differ only there ("col a", "col_a") never share a folder."""
    slug = re.sub(r"[^A-Za-z0-9.-]+", "_", text).strip("_")[-100:] or "model"
    if slug == text:
        return slug
    import hashlib

    return f"{slug[:91]}_{hashlib.sha256(text.encode()).hexdigest()[:8]}"


class Service:
    """The running service: the queue, the HTTP endpoints, the workers and the housekeeping
    thread (tags and polling). Built by :func:`command`; ``start`` then ``wait``."""

    def __init__(self, state: pathlib.Path, policy_path: str, models, workers: int, max_attempts: int,
                 backoff_s: float, secret: str | None, poll_seconds: float, backfill: bool,
                 ray_address: str | None = None):
        self.state = state
        self.policy_path = policy_path
        self.models = tuple(models)
        self.workers = workers
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.secret = secret
        self.poll_seconds = poll_seconds
        self.backfill = backfill
        self.stop = threading.Event()
        self.wake = threading.Event()  # a transition happened: write the tags now
        self.ready = threading.Event()  # workers started: /health says ok (before: starting, 503)
        self._print_lock = threading.Lock()
        self._seen: set[tuple[str, str]] = set()  # versions the poller already decided about
        self._threads: list[threading.Thread] = []
        self.server = None
        self._lock = None
        self.ray_address = ray_address  # set: each job's pipeline runs on that Ray cluster
        self.launcher = None

    # ------------------------------------------------------------------------------ start
    def start(self, host: str, port: int, register_webhook: str | None) -> None:
        """Check, bind, recover and start the threads; on any failure release what was taken."""
        try:
            self._start(host, port, register_webhook)
        except BaseException:
            self.stop.set()
            if self.server is not None:
                if self._threads:  # serving already (before the webhook's test delivery): stop the loop first
                    self.server.shutdown()
                self.server.server_close()
            if getattr(self, "queue", None) is not None:
                self.queue.close()
            if self._lock is not None:
                self._lock.release()
            if self.launcher is not None:
                self.launcher.close()
            raise

    def _start(self, host: str, port: int, register_webhook: str | None) -> None:
        from mlflow_di.errors import UserError
        from mlflow_di.mlflow_edge import connection, watch
        from mlflow_di.service.http import ServiceServer
        from mlflow_di.service.queue import JobQueue

        self.state.mkdir(parents=True, exist_ok=True)
        self._lock_state()
        self.policy = self.state / "policy.yaml"  # the policy checked at start is the one every job runs
        partial = self.state / ".policy.yaml.partial"
        partial.write_bytes(pathlib.Path(self.policy_path).read_bytes())
        os.replace(partial, self.policy)
        self.launcher = self._launcher()  # an unreachable cluster: one line, before any port is bound
        self.workers = self.workers or self._default_workers()
        self.queue = JobQueue(self.state / "jobs.sqlite")
        try:
            self.server = ServiceServer(host, port, self, on_error=self._say)
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (pass another --port)") from None
        self.tracking_uri = connection.tracking_uri()
        self.since_ms = 0 if self.backfill else int(self.queue.first_started_at() * 1000)
        self._spawn(self.server.serve_forever, "http")  # listening before the server's test delivery comes
        if register_webhook:
            webhook_id, how = watch.ensure_webhook(WEBHOOK_NAME, register_webhook, self.secret)
            problem = watch.check_delivery(webhook_id, register_webhook)
            if problem:
                raise UserError(f"webhook {webhook_id} ({register_webhook}) was {how}, but {problem}")
            self._say(f"webhook {webhook_id} {how} and tested: model_version.created -> {register_webhook}")
        self._recover()
        self._spawn(self._housekeeping, "housekeeping")
        from mlflow_di.service.worker import Runner

        runner = Runner(self.queue, self._argv, self._log_path, max_attempts=self.max_attempts,
                        backoff_s=self.backoff_s, stop=self.stop, report=self._report, env=self._child_env(),
                        report_error=self._say, launcher=self.launcher)
        for number in range(self.workers):
            self._spawn(runner.loop, f"worker-{number + 1}")
        polling = (f"polling every {self.poll_seconds:g} s" if self.poll_seconds else
                   f"reading the registry at start, {RECONCILE_AFTER_START_S:g} s later and every {RECONCILE_S:g} s "
                   "for what a webhook missed")
        hooks = "webhooks at POST /webhook" if self.secret else "no webhooks (no --webhook-secret-env)"
        models = ", ".join(self.models) if self.models else "every model"
        where = (f"pipelines on Ray at {self.ray_address}, {self.launcher.resources} each" if self.ray_address else
                 "pipelines in subprocesses")
        self._say(f"serving {self.server.url} for {self.tracking_uri} ({models}; {polling}; {hooks}; "
                  f"{self.workers} worker(s), {where}; state {self.state})")
        self.ready.set()  # after the line: whoever sees /health ok finds the service's settings in its log

    def _launcher(self):
        """Where the jobs' pipelines run: subprocesses here, or actors on the Ray cluster at ``ray_address``."""
        from mlflow_di.service.worker import LocalLauncher

        if not self.ray_address:
            return LocalLauncher()
        from mlflow_di.policy import load_policy
        from mlflow_di.service.ray_jobs import RayLauncher, job_resources

        policy = load_policy(str(self.policy))
        return RayLauncher(self.ray_address, job_resources(policy.ray), self.state / "pipelines",
                           self.policy.read_text(), steps_address=policy.ray.address)

    def _default_workers(self) -> int:
        """One pipeline per CPU core here; on Ray, as many as the cluster's CPUs hold."""
        if self.ray_address:
            return self.launcher.default_workers()
        return max(1, os.cpu_count() or 1)

    def _lock_state(self) -> None:
        """One service per state folder: a second one would run the same jobs."""
        from mlflow_di.folder_lock import FolderLock

        self._lock = FolderLock(self.state, "the service state folder", lock_file=self.state / "serve.lock",
                                advice="stop that mlflow-di serve or pass another --state-dir").acquire()

    def _recover(self) -> None:
        """Jobs a dead service left running: stop any pipeline it left behind, queue them again."""
        from mlflow_di.service.worker import stop_orphan

        for job in self.queue.recover():
            if job.pid and stop_orphan(job.pid, str(self._pipeline_dir(job))):
                self._report(job, f"stopped pipeline process {job.pid} left by the previous service")
            self._report(self.queue.job(job.id), "queued again: the previous service stopped during its run")

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ------------------------------------------------------------------------------ stop
    def wait(self) -> None:
        """Serve until Ctrl-C or SIGTERM; then stop and return (exit 0)."""
        try:
            while not self.stop.is_set():
                self.stop.wait(0.5)
        except KeyboardInterrupt:  # SIGTERM arrives as Terminated, a KeyboardInterrupt
            pass
        # a second signal must not cut the clean-up short; the handlers come back after it (a process
        # that served in-process, a test, goes on with its own)
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.stop.set()
            self.server.shutdown()
            for thread in self._threads:
                thread.join(timeout=30)
            running = len(self.queue.jobs("running"))
            self.queue.close()
            self.launcher.close()
            self._lock and self._lock.release()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._say(f"stopped; {running} running job(s) resume on the next start" if running else "stopped")

    # ------------------------------------------------------------------------------ jobs
    def _pipeline_dir(self, job) -> pathlib.Path:
        return (self.state / "pipelines" / _slug(f"{job.model}-{job.version}")).resolve()

    def _log_path(self, job) -> pathlib.Path:
        return self.state / "logs" / f"{_slug(f'{job.model}-{job.version}')}.log"

    def _argv(self, job) -> list[str]:
        return [sys.executable, "-m", "mlflow_di.cli", "pipeline", "--policy", str(self.policy.resolve()),
                "--model-uri", f"models:/{job.model}/{job.version}", "--state-dir", str(self._pipeline_dir(job))]

    def _child_env(self) -> dict:
        env = dict(os.environ)
        env["MLFLOW_TRACKING_URI"] = self.tracking_uri
        threads = str(max(1, (os.cpu_count() or 1) // self.workers))  # the cores shared out between the workers
        for name in ("MLFLOW_DI_THREADS", "OMP_NUM_THREADS"):
            env.setdefault(name, threads)
        env["PYTHONUNBUFFERED"] = "1"
        for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID"):  # each pipeline starts its own run
            env.pop(name, None)
        return env

    def _say(self, line: str) -> None:
        from mlflow_di.printable import printable

        with self._print_lock:  # names come from the registry and from webhook bodies: shown, never obeyed
            click.echo(f"{_now()} {printable(line)}")

    def _report(self, job, text: str) -> None:
        self._say(f"{job.key} {text}")
        self.wake.set()

    def offer(self, name: str, version: str, run_id: str | None, source: str) -> tuple[int, dict]:
        """Queue ``name``/``version`` if it is a job (a model we watch, not an export of ours);
        (HTTP status, answer): 503 when the registry cannot say."""
        from mlflow_di.errors import UserError
        from mlflow_di.mlflow_edge import watch

        if self.models and name not in self.models:
            return 200, {"ignored": f"{name} is not a --model this service watches"}
        try:
            if source == "webhook" and not self.backfill and watch.created_ms(name, version) < self.since_ms:
                return 200, {"ignored": f"models:/{name}/{version} was created before this service started (--backfill "
                                        "queues such versions)"}
            if watch.made_by_mlflow_di(name, version, run_id):
                return 200, {"ignored": f"models:/{name}/{version} is an export registered by mlflow-di"}
        except watch.VersionAbsent as exc:  # nothing to retry: MLflow redelivers only what failed with a 5xx
            return 404, {"error": str(exc)}
        except UserError as exc:
            return 503, {"error": str(exc)}
        if self.queue.enqueue(name, version, source):
            self._report(self.queue.find(name, version), f"queued ({source})")
        return 200, {"job": self.queue.find(name, version).to_dict()}

    # ------------------------------------------------------------------------------ housekeeping
    def _housekeeping(self) -> None:
        """Write the tags the queue's transitions call for; poll the registry when due."""
        started = time.monotonic()
        next_poll = started
        retry_at: dict[int, float] = {}
        while not self.stop.is_set():
            try:
                self._sync_tags(retry_at)
                if time.monotonic() >= next_poll:
                    next_poll = poll_due_after(time.monotonic() - started, self.poll_seconds) + started
                    self._poll()
            except Exception as exc:  # noqa: BLE001 - the service outlives a registry hiccup; the next round retries
                self._say(f"housekeeping failed ({type(exc).__name__}: {str(exc).strip()[:300]}); going on")
            self.wake.wait(min(1.0, max(0.05, next_poll - time.monotonic())))
            self.wake.clear()

    def _sync_tags(self, retry_at: dict[int, float]) -> None:
        from mlflow_di.errors import UserError
        from mlflow_di.mlflow_edge import watch

        for job in self.queue.untagged():
            if self.stop.is_set() or time.monotonic() < retry_at.get(job.id, 0.0):
                continue
            try:
                watch.write_status(job.model, job.version, job.state, job.attempts)
            except UserError as exc:
                if _vanished(job):  # deleted from the registry: nothing left to tag, nor to judge
                    gone = self.queue.drop_vanished(job.id, "the version was deleted from the registry")
                    self.queue.mark_tagged(gone.id, gone.tag_mark)
                    self._say(f"{job.key} is no longer in the registry; {gone.state}, its tags given up")
                    continue
                self._say(f"{job.key} tags not written ({exc}); trying again in {TAG_RETRY_S:g} s")
                retry_at[job.id] = time.monotonic() + TAG_RETRY_S
                continue
            retry_at.pop(job.id, None)
            self.queue.mark_tagged(job.id, job.tag_mark)

    def _poll(self) -> None:
        """Queue every version created since the service first started that no poll queued yet (with
        ``--poll-seconds 0`` this is the reconciling look behind the webhooks)."""
        from mlflow_di.errors import UserError
        from mlflow_di.mlflow_edge import watch

        try:
            versions = watch.new_versions(self.since_ms, self.models)
        except UserError as exc:
            self._say(f"poll failed ({exc}); trying again in {self.poll_seconds:g} s")
            return
        for version in versions:
            key = (version.name, str(version.version))
            if key in self._seen or self.stop.is_set():
                continue
            status, _ = self.offer(version.name, str(version.version), version.run_id,
                                   "poll" if self.poll_seconds else "reconcile")
            if status == 200:
                self._seen.add(key)

    # ------------------------------------------------------------------------------ HTTP
    def health(self) -> dict:
        from mlflow_di import __version__

        return {"status": "ok" if self.ready.is_set() else "starting", "version": __version__,
                "jobs": self.queue.counts(), "workers": self.workers, "ray_address": self.ray_address,
                "poll_seconds": self.poll_seconds, "webhooks": self.secret is not None}

    def jobs(self, state: str | None) -> dict:
        from mlflow_di.service.queue import STATES

        if state is not None and state not in STATES:
            return {"error": f"unknown state {state!r}; one of {', '.join(STATES)}", "jobs": []}
        return {"jobs": [job.to_dict() for job in self.queue.jobs(state)]}

    def webhook(self, headers, body: bytes) -> tuple[int, dict]:
        from mlflow_di.service import signature

        if self.secret is None:
            return 404, {"error": "webhooks are off: start the service with --webhook-secret-env VAR"}
        reason = signature.check(self.secret, headers, body)
        if reason is not None:
            self._say(f"refused a webhook: {reason}")
            return 401, {"error": reason}
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python's stack (a crafted body)
            payload = None
        if not isinstance(payload, dict):
            return 400, {"error": "the body is not a JSON webhook payload (an object with entity, action and data)"}
        event = f"{payload.get('entity')}.{payload.get('action')}"
        if event != "model_version.created":
            return 200, {"ignored": f"event {event[:100]}"}
        data = payload.get("data")
        name, version = (data.get("name"), data.get("version")) if isinstance(data, dict) else (None, None)
        if not (isinstance(name, str) and name and isinstance(version, (str, int)) and not isinstance(version, bool)
                and str(version).strip()):
            return 400, {"error": "a model_version.created payload without data.name and data.version"}
        if not re.fullmatch(r"[0-9]{1,18}", str(version).strip()) or "/" in name or ":" in name or len(name) > 1000:
            return 400, {"error": "data.name must be a registered model's name and data.version a version number"}
        try:
            return self.offer(name, str(version).strip(), data.get("run_id"), "webhook")
        except Exception as exc:  # noqa: BLE001 - MLflow retries a 5xx delivery
            return 503, {"error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
