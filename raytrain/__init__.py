"""raytrain: elastic, fault-tolerant data-parallel PyTorch training on Ray."""

from raytrain.config import TrainConfig
from raytrain.driver.run import FitResult, fit
from raytrain.errors import ConfigError, RunFailed
from raytrain.pipeline import Pipeline, context
from raytrain.sampled import Sampled
from raytrain.tune import tune

__version__ = "0.1.0"

__all__ = ["ConfigError", "FitResult", "Pipeline", "RunFailed", "Sampled", "TrainConfig", "context", "fit", "tune"]
