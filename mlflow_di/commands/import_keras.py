"""``mlflow-di import-keras``: port a Keras HDF5 reference model to PyTorch and register it."""
from __future__ import annotations

import click
import mlflow

from mlflow_di import tracking
from mlflow_di.data import load_images


@click.command("import-keras")
@click.option("--arch", required=True, help="Architecture of the file: lenet1, lenet4, lenet5, lenet1-same, lenet5-same, resnet20.")
@click.option("--weights", required=True, type=click.Path(dir_okay=False), help="Keras HDF5 file (.h5).")
@click.option("--register-as", required=True, help="Registered model name to create a version of.")
@click.option("--eval-data", default=None, help="Data spec to measure and log the accuracy on, e.g. mnist:../shared/data/mnist.")
def command(arch: str, weights: str, register_as: str, eval_data: str | None) -> None:
    """Import Keras weights (read with h5py, no TensorFlow) into the PyTorch ARCH and register it."""
    from mlflow_di.models.keras_import import import_keras

    model = import_keras(arch, weights)
    data = load_images(eval_data) if eval_data else None
    with tracking.tracked_run(f"import-keras-{arch}", tags={"mlflow_di.command": "import-keras"}) as run:
        tracking.log_params({"arch": arch, "weights": weights})
        if data is not None:
            accuracy = float((model.classifier().predict(data.images) == data.labels).mean())
            mlflow.log_metrics({"accuracy": accuracy, "eval_images": len(data)})
            click.echo(f"accuracy on {data.name}: {accuracy:.2%} ({len(data)} images)")
        info = tracking.log_torch_model(model, registered_model_name=register_as)
    version = info.registered_model_version
    click.echo(f"registered models:/{register_as}/{version} (run {run.info.run_id})")

