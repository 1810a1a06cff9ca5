"""The pieces of ``mlflow-di serve`` that need no MLflow: the durable job queue, the webhook
signature check, the HTTP endpoints and the workers that run each job's pipeline in a
subprocess. ``commands/serve.py`` wires them to the registry through ``mlflow_edge/watch.py``.
"""
