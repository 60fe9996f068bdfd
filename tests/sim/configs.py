"""Model shapes the dry-run tests simulate: every dimension that FSDP shards on dim 0 is a
multiple of 1,024, so that at 64 and 1,024 ranks no parameter is padded and the formulas'
figures hold exactly (padding is what they leave out)."""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.models import GPTConfig

# the smallest demo GPT the cost and bookkeeping tests wrap (its dims need no such multiple)
TINY = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=128, seq_len=16)
DEMO = GPTConfig(n_layer=1, d_model=1024, n_head=8, vocab_size=1024, seq_len=1024)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
         "intermediate_size": 4096, "num_attention_heads": 8, "num_hidden_layers": 1,
         "num_key_value_heads": 8, "vocab_size": 4096, "max_position_embeddings": 1024}


def llama_file(directory: Path) -> Path:
    path = directory / "llama.json"
    path.write_text(json.dumps(LLAMA))
    return path
