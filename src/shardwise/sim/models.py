"""The models a dry run wraps, built on the meta device: the demo GPT, or a module with the
parameter shapes of a Hugging Face causal LM's ``config.json`` (GPT-2 or Llama style).

The Hugging Face shapes follow shardwise/memory/hf_config.py (which validates the config and
counts its parameters; tests check that the module built here has exactly that count). Their
``forward`` touches every parameter in the order a real layer does (attention, then MLP), so
autograd produces every gradient and FSDP gathers and reduces every unit; the arithmetic is not
a faithful attention (a dry run computes no values, see [Note: simulated ranks]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.memory.hf_config import HFConfigError, load_hf_config
from shardwise.models import GPT, GPTConfig


def demo_gpt(cfg: GPTConfig) -> nn.Module:
    with torch.device("meta"):
        return GPT(cfg)


def hf_model(path: str | Path) -> nn.Module:
    """A meta-device module shaped like the causal LM that ``path`` (a config.json) describes;
    HFConfigError (one line) when it is not such a config."""
    load_hf_config(path)  # validates: names the missing or wrong field
    config = json.loads(Path(path).read_text())
    with torch.device("meta"):
        if config["model_type"] == "gpt2":
            return GPT2Shaped(config)
        return LlamaShaped(config)


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The transformer layers, each an FSDP unit of its own."""
    return model.blocks


def sequence_length(model: nn.Module) -> int:
    return int(getattr(model, "max_seq", None) or 16)


class _RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _LlamaLayer(nn.Module):
    def __init__(self, h: int, heads: int, kv: int, head_dim: int, inner: int,
                 qkv_bias: bool, o_bias: bool, mlp_bias: bool):
        super().__init__()
        self.group = heads // kv
        self.input_layernorm = _RMSNorm(h)
        self.q_proj = nn.Linear(h, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, kv * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, kv * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, h, bias=o_bias)
        self.post_attention_layernorm = _RMSNorm(h)
        self.gate_proj = nn.Linear(h, inner, bias=mlp_bias)
        self.up_proj = nn.Linear(h, inner, bias=mlp_bias)
        self.down_proj = nn.Linear(inner, h, bias=mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.input_layernorm(x)
        kv = (self.k_proj(a) * self.v_proj(a)).repeat_interleave(self.group, dim=-1)
        x = x + self.o_proj(self.q_proj(a) * kv)
        m = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class LlamaShaped(nn.Module):
    """Llama / Mistral / Qwen2 parameter shapes (see memory/hf_config.py)."""

    def __init__(self, c: dict[str, Any]):
        super().__init__()
        h, heads = c["hidden_size"], c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or h // heads
        qkv_bias = c["model_type"] == "qwen2" or bool(c.get("attention_bias", False))
        self.max_seq = c.get("max_position_embeddings")
        self.embed_tokens = nn.Embedding(c["vocab_size"], h)
        self.blocks = nn.ModuleList(
            _LlamaLayer(h, heads, kv, head_dim, c["intermediate_size"], qkv_bias,
                        bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False)))
            for _ in range(c["num_hidden_layers"]))
        self.norm = _RMSNorm(h)
        self.tied = bool(c.get("tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(h, c["vocab_size"], bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return x @ weight.t()


class _GPT2Layer(nn.Module):
    def __init__(self, h: int, inner: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.c_attn, self.attn_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.c_fc, self.mlp_proj = nn.Linear(h, inner), nn.Linear(inner, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.attn_proj(q * k * v)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT2Shaped(nn.Module):
    """GPT-2 parameter shapes: learned positions, the head tied to the token embedding."""

    def __init__(self, c: dict[str, Any]):
        super().__init__()
        h = c["n_embd"]
        inner = c.get("n_inner") or 4 * h
        self.max_seq = c["n_positions"]
        self.wte = nn.Embedding(c["vocab_size"], h)
        self.wpe = nn.Embedding(c["n_positions"], h)
        self.blocks = nn.ModuleList(_GPT2Layer(h, inner) for _ in range(c["n_layer"]))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


__all__ = ["GPT2Shaped", "HFConfigError", "LlamaShaped", "blocks_of", "demo_gpt", "hf_model"]
