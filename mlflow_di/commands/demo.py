"""``mlflow-di demo``: the whole product on the embedded default, with no flags and no server.

Trains the small digits CNN on scikit-learn's bundled 8x8 digits, logs it (pickle format, with
its preprocessing) and registers it in the current tracking store (by default
``sqlite:///mlflow.db`` in this folder), then says what was created and where to look.
"""
from __future__ import annotations

import time

import click
import mlflow
import numpy as np

from mlflow_di import tracking
from mlflow_di.commands.options import seed_option
from mlflow_di.data import load_images
from mlflow_di.models.torch_model import TorchModel

TRAIN_SPEC = "digits[0:1300]"
TEST_SPEC = "digits[1300:]"


@click.command("demo")
@click.option("--register-as", default="digits-cnn", show_default=True, help="Registered model name for the trained CNN.")
@click.option("--epochs", type=click.IntRange(1, 500), default=40, show_default=True, help="Training epochs.")
@seed_option
def command(register_as: str, epochs: int, seed: int) -> None:
    """Train the digits CNN, log it and register it in the MLflow model registry."""
    started = time.perf_counter()
    train, test = load_images(TRAIN_SPEC), load_images(TEST_SPEC)
    click.echo(f"tracking store: {mlflow.get_tracking_uri()}")
    with tracking.tracked_run("demo", tags={"mlflow_di.command": "demo"}) as run:
        model, accuracy = train_digits_cnn(train, test, epochs, seed)
        info = tracking.log_torch_model(model, registered_model_name=register_as)
    version = info.registered_model_version
    click.echo(f"trained digits-cnn on {TRAIN_SPEC}: test accuracy {accuracy:.2%} on {TEST_SPEC} ({len(test)} images)")
    click.echo(f"run:              {run.info.run_id} (experiment '{tracking.DEFAULT_EXPERIMENT}')")
    click.echo(f"registered model: models:/{register_as}/{version}")
    click.echo(f"done in {time.perf_counter() - started:.1f} s")
    click.echo("")
    click.echo("next:")
    click.echo(f"  mlflow-di describe models:/{register_as}/{version}")
    click.echo(f"  mlflow ui --backend-store-uri {mlflow.get_tracking_uri()}   # then open http://127.0.0.1:5000")


def train_digits_cnn(train, test, epochs: int, seed: int) -> tuple[TorchModel, float]:
    """Train ``digits-cnn`` from seed ``seed``; log params and metrics to the active run."""
    import torch

    from mlflow_di.models import zoo
    from mlflow_di.models.training import train_classifier

    spec = zoo.architecture("digits-cnn")
    model = TorchModel(zoo.build("digits-cnn", seed=seed), spec.preprocessing, name="digits-cnn",
                       metadata={"arch": "digits-cnn", "train_data": TRAIN_SPEC})
    mlflow.log_params({"arch": "digits-cnn", "train_data": TRAIN_SPEC, "test_data": TEST_SPEC,
                       "epochs": epochs, "seed": seed})
    losses = train_classifier(model.module, model.to_tensor(train.images), torch.from_numpy(train.labels),
                              epochs=epochs, seed=seed)
    model.module.eval()
    accuracy = float(np.mean(model.classifier().predict(test.images) == test.labels))
    for epoch, loss in enumerate(losses):
        mlflow.log_metric("train_loss", float(loss), step=epoch)
    mlflow.log_metric("test_accuracy", accuracy)
    return model, accuracy
