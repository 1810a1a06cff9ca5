"""Make the report screenshots of the docs' Concepts pages (docs/img/report-*.png).

    .venv/bin/python docs/screenshots.py          # about a minute on 2 cores; needs chromium

It runs the demo, ``inspect`` and ``repair`` in a temporary folder (its own local store), takes each
command's ``report.html`` from the runs' artifacts and has headless Chromium photograph the top
of it. Run it again when a report's layout changes; the images are committed.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

DOCS = pathlib.Path(__file__).resolve().parent
IMAGES = DOCS / "img"
#: (artifact path of the report, picture name, window height in pixels, tags its run must have)
REPORTS = (
    ("coverage/report.html", "report-coverage", 1500, {}),
    ("fuzz/report.html", "report-fuzz", 1500, {}),
    ("gate/report.html", "report-gate", 1000, {}),
    ("compress/report.html", "report-compress", 1300, {"mlflow_di.method": "int8-static"}),
    ("inspection/report.html", "report-inspection", 1300, {}),
    ("repair/report.html", "report-repair", 1300, {}),
)


def run(command: list[str], cwd: pathlib.Path) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        print("needs chromium (make browser installs it)", file=sys.stderr)
        return 2
    bin_dir = pathlib.Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as scratch:
        work = pathlib.Path(scratch)
        run([str(bin_dir / "mlflow-di"), "demo"], work)
        run([str(bin_dir / "mlflow-di"), "inspect", "--model-uri", "models:/digits-cnn/1", "--data", "digits[0:600]",
             "--coverage", "latest"], work)
        run([str(bin_dir / "mlflow-di"), "repair", "--compressed", "models:/digits-cnn-prune-l1/1", "--campaign",
             "latest"], work)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
        import mlflow

        client = mlflow.MlflowClient()
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()], order_by=["start_time DESC"])
        for artifact, name, height, tags in REPORTS:
            owner = next(r for r in runs if all(r.data.tags.get(k) == v for k, v in tags.items())
                         and _has(client, r.info.run_id, artifact))
            local = mlflow.artifacts.download_artifacts(run_id=owner.info.run_id, artifact_path=artifact,
                                                       dst_path=str(work / name))
            picture = IMAGES / f"{name}.png"
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--window-size=1200,{height}", f"--screenshot={picture}",
                            pathlib.Path(local).as_uri()], check=True, capture_output=True)
            print(f"{picture.relative_to(DOCS.parent)} <- run {owner.info.run_id} {artifact}")
    return 0


def _has(client, run_id: str, artifact: str) -> bool:
    folder, _, name = artifact.rpartition("/")
    return any(f.path == artifact for f in client.list_artifacts(run_id, folder))


if __name__ == "__main__":
    sys.exit(main())
