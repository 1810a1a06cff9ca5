"""``serve --ray-address``: each job's pipeline in an actor on a Ray cluster instead of a subprocess here.

The service stays the one place that holds the queue, talks to the registry and answers webhooks;
only the pipelines move. Each job gets one actor (:class:`PipelineProcess`) reserving the job's
CPUs and GPUs; the actor starts the same ``python -m mlflow_di.cli pipeline ...`` command on its
node, in its own session, and the service polls it every half second for the exit code and the
output written since, which it appends to the job's log here (so logs need no shared storage).

- **State.** The pipeline resumes from its state folder (state.json, the fuzz campaign). When the
  node sees the service's state folder (a cluster on one machine, or storage every node mounts at
  the same path, as Ray advises for its own ``storage_path``), the pipeline uses the service's
  folder for the job and a retry on any node resumes; otherwise it uses a folder in the node's
  temporary directory, and the job's log says that a retry on another node starts over (its
  finished MLflow runs stay in the registry). A marker file with a random token tells the two apart.
- **Stopping.** The service's stop asks the actor to SIGTERM the pipeline's process group (a
  grace period to end its runs, then SIGKILL) and then kills the actor. The pipeline also gets
  SIGTERM when its actor's process dies for any reason (Linux's parent-death signal), and Ray
  kills a service's actors when the service dies, so nothing is left running on the cluster.
- **Lost work.** An actor that dies (its node removed, out of memory) is a pipeline without an
  exit code: the queue retries the job by its rules (``--max-attempts``, ``--retry-backoff``).

Ray is imported only inside the launcher's methods.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from mlflow_di.service.worker import STOP_GRACE_S, PipelineLost

#: The file in the service's pipelines folder whose token a node reads to know it sees that folder.
MARKER = ".mlflow-di-service-token"
#: Bytes of output one poll brings back at most (the rest comes with the next polls).
POLL_BYTES = 1 << 20
#: Seconds a job waits for the cluster to place its actor before its log says so.
WAITING_SAID_AFTER_S = 10.0
#: Seconds one call to an actor may take before the actor counts as lost.
CALL_TIMEOUT_S = 60.0
#: Environment variables the pipeline gets from the service (the tracking server, its credentials, mlflow-di's own;
#: the thread counts come from the job's CPUs): everything else is the node's own.
PASSED_PREFIXES = ("MLFLOW_", "AWS_", "AZURE_", "GOOGLE_APPLICATION_CREDENTIALS")


@dataclasses.dataclass
class JobResources:
    """What one job's actor reserves on the cluster; the pipeline's models get ``threads`` threads."""

    cpus: float = 1.0
    gpus: float = 0.0

    @property
    def threads(self) -> int:
        return max(1, int(self.cpus))

    def __str__(self) -> str:
        return f"{self.cpus:g} CPU" + (f", {self.gpus:g} GPU" if self.gpus else "")


def job_resources(ray_policy) -> JobResources:
    """A job's reservation from the policy's ``ray`` section: the pipeline's own process coordinates when the
    steps have Ray workers of their own (1 CPU), and does the work itself when they have none (one worker's
    CPUs and GPUs)."""
    if ray_policy.workers:
        return JobResources(1.0, 0.0)
    return JobResources(ray_policy.cpus_per_worker or 1.0, ray_policy.gpus_per_worker or 0.0)


class RayLauncher:
    """Starts each job's pipeline in a :class:`PipelineProcess` actor on the cluster at ``address``.

    ``pipelines``: the service's folder of per-job pipeline folders (a marker token is written in
    it so that nodes can tell whether they see it); ``policy_text``: the policy every job runs,
    sent with the job so that nodes need not see the service's files; ``steps_address``: the
    policy's ``ray.address``, where the steps' own Ray workers go (None: the cluster the job runs on).
    """

    def __init__(self, address: str, resources: JobResources, pipelines: pathlib.Path, policy_text: str,
                 steps_address: str | None = None):
        from mlflow_di._ray import connect

        self.ray, self._started = connect(address)
        self.resources = resources
        self.pipelines = pipelines
        self.policy_text = policy_text
        self.steps_address = steps_address
        pipelines.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        (pipelines / MARKER).write_text(self.token)
        self._actor_class = self.ray.remote(PipelineProcess)

    def default_workers(self) -> int:
        """Jobs the cluster's CPUs hold at once."""
        cpus = float(self.ray.cluster_resources().get("CPU", 0.0))
        return max(1, int(cpus // max(self.resources.cpus, 1e-9)))

    def start(self, argv: list[str], env: dict | None, log) -> "RayPipeline":
        arguments, paths = _without_paths(argv[argv.index("mlflow_di.cli") + 1:])  # the node's Python, its paths
        folder_name = pathlib.Path(paths["--state-dir"]).name
        if self.steps_address is not None:  # named, so the actor does not point the steps at its own cluster
            arguments = [*arguments, "--ray-address", self.steps_address]
        actor = self._actor_class.options(num_cpus=self.resources.cpus, num_gpus=self.resources.gpus,
                                          max_restarts=0, max_task_retries=0).remote()
        passed = {name: value for name, value in (env or os.environ).items() if name.startswith(PASSED_PREFIXES)}
        for name in ("MLFLOW_DI_THREADS", "OMP_NUM_THREADS"):
            passed[name] = str(self.resources.threads)
        passed["PYTHONUNBUFFERED"] = "1"
        started = actor.start.remote(arguments, passed, self.policy_text, JobFolder(str(self.pipelines), folder_name,
                                                                                  self.token))
        return RayPipeline(self.ray, actor, started, log, self.resources)

    def close(self) -> None:
        if self._started:
            self.ray.shutdown()


class RayPipeline:
    """A pipeline running in an actor: polled for its output and exit code, stopped through the actor."""

    pid = None  # on another machine, maybe: the queue's orphan check must not act on it

    def __init__(self, ray, actor, started, log, resources: JobResources):
        self.ray, self.actor, self.started, self.log, self.resources = ray, actor, started, log, resources
        self.since = time.monotonic()
        self.running = False
        self.waiting_said = False

    def poll(self) -> int | None:
        ray = self.ray
        try:
            if not self.running:
                ready, _ = ray.wait([self.started], timeout=0)
                if not ready:
                    if not self.waiting_said and time.monotonic() - self.since > WAITING_SAID_AFTER_S:
                        self._write(f"waiting for the cluster to hold this job's actor ({self.resources})\n".encode())
                        self.waiting_said = True
                    return None
                self._write(ray.get(self.started).encode())
                self.running = True
            code, output = ray.get(self.actor.poll.remote(), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            self._kill()
            raise PipelineLost(f"the Ray actor running the pipeline was lost ({_first_line(exc)})") from None
        self._write(output)
        return code

    def stop(self) -> None:
        try:
            output = self.ray.get(self.actor.stop.remote(STOP_GRACE_S), timeout=STOP_GRACE_S + CALL_TIMEOUT_S)
            self._write(output)
        except self.ray.exceptions.RayError:
            pass  # already gone: so is its pipeline (it gets SIGTERM when its actor's process dies)
        finally:
            self._kill()

    def _kill(self) -> None:
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead, or the cluster gone: nothing left to stop
            pass

    def _write(self, data: bytes) -> None:
        if data:
            self.log.write(data)
            self.log.flush()


def _first_line(exc: BaseException) -> str:
    from mlflow_di._ray import first_line

    return first_line(exc)[:300]


class PipelineProcess:
    """The actor: runs one job's pipeline command on its node (a subprocess in its own session), reports its
    output and exit code, stops it on request. Plain Python, made an actor by :class:`RayLauncher`."""

    def __init__(self):
        self.child = None
        self.output = None
        self.offset = 0

    def start(self, arguments: list[str], env: dict, policy_text: str, folder: "JobFolder") -> str:
        """Start the pipeline; returns the line that opens its output in the job's log (node, state folder).

        Without ``--ray-address`` in ``arguments`` (the policy names none), the steps' own Ray workers join
        the cluster this actor runs on, not a new one on its node."""
        import ray

        context = ray.get_runtime_context()
        job_folder = pathlib.Path(folder.pipelines) / folder.name
        shared = _reads(pathlib.Path(folder.pipelines) / MARKER) == folder.token
        if not shared:
            job_folder = pathlib.Path(tempfile.gettempdir()) / "mlflow-di-service" / folder.name
        if "--ray-address" not in arguments:
            arguments = [*arguments, "--ray-address", context.gcs_address]
        job_folder.mkdir(parents=True, exist_ok=True)
        policy = job_folder.parent / f".{job_folder.name}.policy.yaml"
        policy.write_text(policy_text)
        argv = [sys.executable, "-m", "mlflow_di.cli", *arguments, "--policy", str(policy), "--state-dir",
                str(job_folder)]
        self.output = tempfile.NamedTemporaryFile(prefix="mlflow-di-job-", suffix=".log", delete=False)
        child_env = {**os.environ, **env}
        for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "RAY_ADDRESS"):  # its own runs; its own Ray connection
            child_env.pop(name, None)
        self.child = subprocess.Popen(argv, stdout=self.output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=child_env, start_new_session=True, preexec_fn=_terminate_with_parent())
        where = (f"{job_folder} (the service's folder, seen from this node: a retry resumes)" if shared else
                 f"{job_folder} on this node (the service's folder is not visible here: a retry on another node "
                 "starts over)")
        return (f"on Ray node {context.get_node_id()[:12]} ({ray.util.get_node_ip_address()}), pipeline pid "
                f"{self.child.pid}, state {where}\n")

    def poll(self) -> tuple[int | None, bytes]:
        """(exit code or None, the output written since the last poll)."""
        code = self.child.poll()
        return code, self._read(everything=code is not None)

    def stop(self, grace: float) -> bytes:
        """SIGTERM the pipeline's process group, SIGKILL after ``grace`` seconds; returns its last output."""
        from mlflow_di.service.worker import stop_group

        if self.child is not None and self.child.poll() is None:
            stop_group(self.child, grace)
        return self._read(everything=True)

    def _read(self, everything: bool) -> bytes:
        chunks = []
        with open(self.output.name, "rb") as source:
            source.seek(self.offset)
            while True:
                chunk = source.read(POLL_BYTES)
                chunks.append(chunk)
                self.offset += len(chunk)
                if not everything or not chunk:
                    break
        return b"".join(chunks)


@dataclasses.dataclass(frozen=True)
class JobFolder:
    """Where a job's pipeline keeps its state: ``pipelines``/``name`` when the node reads ``token`` in
    ``pipelines``' marker file (it sees the service's folder), else ``name`` in the node's temporary folder."""

    pipelines: str
    name: str
    token: str


def _without_paths(arguments: list[str]) -> tuple[list[str], dict]:
    """``arguments`` without ``--policy`` and ``--state-dir`` (paths on the service's machine), and those values."""
    kept, paths, index = [], {}, 0
    while index < len(arguments):
        if arguments[index] in ("--policy", "--state-dir"):
            paths[arguments[index]] = arguments[index + 1]
            index += 2
            continue
        kept.append(arguments[index])
        index += 1
    return kept, paths


def _reads(path: pathlib.Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _terminate_with_parent():
    """A ``preexec_fn`` giving the child SIGTERM when the actor's process dies (Linux ``PR_SET_PDEATHSIG``); None
    elsewhere, where the service's stop and Ray's end of the actor are what stops the pipeline."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child only calls into it
    set_parent_death_signal = 1  # PR_SET_PDEATHSIG

    def arm() -> None:
        libc.prctl(set_parent_death_signal, signal.SIGTERM)

    return arm

