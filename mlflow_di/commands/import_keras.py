"""``mlflow-di import-keras``: port a Keras HDF5 reference model to PyTorch and register it."""
from __future__ import annotations

import click

from mlflow_di.commands.options import LazyChoice, ModelName


@click.command("import-keras")
@click.option("--arch", required=True, type=LazyChoice("mlflow_di.models.zoo:ARCHITECTURES", "architecture", in_help=False),
              help="Architecture of the file.")
@click.option("--weights", required=True, type=click.Path(exists=True, dir_okay=False), help="Keras HDF5 file (.h5).")
@click.option("--register-as", type=ModelName(), required=True, help="Registered model name to create a version of.")
@click.option("--eval-data", default=None,
              help="Data spec to measure and log the accuracy on, e.g. mnist-test:../shared/data/mnist.")
def command(arch: str, weights: str, register_as: str, eval_data: str | None) -> None:
    """Import Keras weights (read with h5py, no TensorFlow) into the PyTorch ARCH and register it."""
    from mlflow_di.data import load_images
    from mlflow_di.mlflow_edge import models, runs
    from mlflow_di.models.keras_import import import_keras

    model = import_keras(arch, weights)
    data = load_images(eval_data) if eval_data else None
    with runs.tracked_run(f"import-keras {arch}", tags={"mlflow_di.command": "import-keras"}) as log:
        log.params({"arch": arch, "weights": weights})
        if data is not None:
            accuracy = float((model.classifier().predict(data.images) == data.labels).mean())
            log.metrics({"accuracy": accuracy, "eval_images": len(data)})
            click.echo(f"accuracy on {data.name}: {accuracy:.2%} ({len(data)} images)")
        info = models.log_torch_model(model, registered_model_name=register_as)
    click.echo(f"registered models:/{register_as}/{info.registered_model_version} (run {log.run_id})")
