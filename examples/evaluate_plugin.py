"""IDC through `mlflow.models.evaluate` with the mlflow_di evaluator plugin.

Run after `make demo` (which registers models:/digits-cnn/1 in ./mlflow.db):
    .venv/bin/python examples/evaluate_plugin.py
"""
import mlflow
import pandas

import mlflow_di

data = mlflow_di.load_images("digits")
frame = pandas.DataFrame(data.images.reshape(len(data), -1)).assign(label=data.labels)
with mlflow.start_run(run_name="evaluate-digits-cnn"):
    result = mlflow.models.evaluate("models:/digits-cnn/1", frame, targets="label", model_type="classifier",
                                    evaluators=["mlflow_di"],
                                    evaluator_config={"mlflow_di": {"input_shape": (8, 8, 1), "top_m": 6}})
print({key: value for key, value in result.metrics.items() if key.startswith("mlflow_di/")})
