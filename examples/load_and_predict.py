"""Load data and a model the way mlflow-di does, and score the model.

Run after `make demo` (which registers models:/digits-cnn/1 in ./mlflow.db):
    .venv/bin/python examples/load_and_predict.py [MODEL_URI] [DATA_SPEC]
"""
import sys

import mlflow_di  # import before torchvision/zennit: applies the CPU-torch guard


def main(uri: str = "models:/digits-cnn/1", spec: str = "digits[1300:]") -> None:
    data = mlflow_di.load_images(spec)
    model = mlflow_di.load_classifier(uri)
    predicted = model.predict(data.images)
    accuracy = (predicted == data.labels).mean()
    print(f"{uri} on {spec}: accuracy {accuracy:.2%} over {len(data)} images ({model.backend} backend)")


if __name__ == "__main__":
    main(*sys.argv[1:])
