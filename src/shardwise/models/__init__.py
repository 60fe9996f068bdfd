"""The demo workload's model: a small GPT written in plain torch.nn."""

from shardwise.models.gpt import GPT, GPTConfig, lm_loss

__all__ = ["GPT", "GPTConfig", "lm_loss"]
