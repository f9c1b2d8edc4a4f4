"""The code file of terascale's MLflow pyfunc model (MLflow's "models from code").

``jobs.tracking`` logs the model with this file as its ``python_model``: MLflow copies the file
into the logged model and runs it when the model is loaded, and it names the model class
(``jobs.mlflow_model.RawLineModel``) instead of a pickled object. Nothing else imports it.
"""

from mlflow.models import set_model

from terascale.jobs.mlflow_model import RawLineModel

set_model(RawLineModel())
