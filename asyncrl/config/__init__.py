"""Configuration: structured schemas, the Hydra loader, the settings of the role commands (roles.py) and
the device grammar (devices.py). Imports no torch or zmq."""

from asyncrl.config.loader import CONFIG_DIR, load_train_config, save_config
from asyncrl.config.schema import (
    AlgoConfig,
    LearnerConfig,
    LogConfig,
    ModelConfig,
    QuantConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    TransportConfig,
    to_dict,
    validate,
)

__all__ = [
    "CONFIG_DIR",
    "AlgoConfig",
    "LearnerConfig",
    "LogConfig",
    "ModelConfig",
    "QuantConfig",
    "RolloutConfig",
    "TaskConfig",
    "TrainConfig",
    "TransportConfig",
    "load_train_config",
    "save_config",
    "to_dict",
    "validate",
]
