"""zerofunc: ZeRO stages 0-3 in a functional style on PyTorch."""
from zerofunc import pretrained
from zerofunc.api import initialize
from zerofunc.config import Config, ConfigError
from zerofunc.engine import ZeroEngine
from zerofunc.optim import AdamWConfig, adamw_
from zerofunc.stages import STAGES, Stage, get_stage
from zerofunc.state import OptimizerState, StepMetrics
from zerofunc.step import num_items_in_batch, train_step

# the step as a function, state in and state out: zerofunc.step.step (not exported here, where it would hide
# the module of that name)
__all__ = ["initialize", "Config", "ConfigError", "ZeroEngine", "AdamWConfig", "adamw_", "STAGES", "Stage", "get_stage",
           "num_items_in_batch", "pretrained", "train_step", "OptimizerState", "StepMetrics"]
