"""DeepBase-style inspection: which hypotheses (ink, loops, class, ...) a model's hidden units respond to.

No MLflow here: :class:`Inspection` runs the query on a :class:`~mlflow_di.models.torch_model.TorchModel`
and returns an :class:`InspectionResult`; ``mlflow-di inspect`` logs it.
"""
from mlflow_di.inspection.hypotheses import Hypothesis, builtin_hypotheses, class_indicator, load_hypotheses
from mlflow_di.inspection.inspector import Inspection, InspectionResult
from mlflow_di.inspection.measures import MEASURES

__all__ = ["Hypothesis", "Inspection", "InspectionResult", "MEASURES", "builtin_hypotheses", "class_indicator",
           "load_hypotheses"]
