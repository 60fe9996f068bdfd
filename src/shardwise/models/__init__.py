"""The demo workload's model: a small GPT written in plain torch.nn."""

from shardwise._lazy import lazy_names

# imported on first use: GPTConfig (models/config.py) costs no torch import
lazy_names(__name__, {"GPT": "shardwise.models.gpt", "GPTConfig": "shardwise.models.config",
                      "lm_loss": "shardwise.models.gpt"})

__all__ = ["GPT", "GPTConfig", "lm_loss"]
