"""Parameter shapes of a Hugging Face causal LM read from its ``config.json`` (no weights, and
no `transformers` needed): what `shardwise plan --hf-config` plans for.

Two families are understood, by ``model_type``:

- GPT-2 style (``gpt2``): learned positions, LayerNorm with bias, a fused ``c_attn`` with bias,
  a GELU MLP of ``n_inner`` (default ``4 * n_embd``), the head tied to the token embedding.
- Llama style (``llama``, ``mistral``, ``qwen2``): RMSNorm, separate q/k/v/o projections with
  grouped key/value heads (``num_key_value_heads``, ``head_dim``), a SwiGLU MLP of
  ``intermediate_size``, the head tied or not (``tie_word_embeddings``); qwen2 adds q/k/v biases,
  ``attention_bias`` / ``mlp_bias`` add them where a config says so.

Each parameter is a ``ParamSize`` whose split dimension is the one a Megatron-style tensor-
parallel plan splits (embeddings and head on the vocabulary, q/k/v and the MLP's first layers on
their outputs, o and the MLP's last layer on their inputs), grouped one unit per layer plus the
root unit, as FSDP wraps a transformer. The counts are exact for these architectures (checked
against the published sizes of GPT-2 and Llama 2 in tests/memory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.memory.activations import TransformerShape
from shardwise.memory.layouts import ParamSize

GPT2_TYPES = ("gpt2",)
LLAMA_TYPES = ("llama", "mistral", "qwen2")
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


class HFConfigError(ValueError):
    """A config.json that `shardwise plan` cannot plan for; the message says why."""


@dataclass(frozen=True)
class ModelSpec:
    """What planning needs of a model: its FSDP units of parameters and, for activations,
    its transformer shape (None when unknown, as for a bare parameter count)."""

    description: str
    units: list[list[ParamSize]]
    shape: TransformerShape | None

    @property
    def n_params(self) -> int:
        return sum(p.numel for unit in self.units for p in unit)


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read ``path`` (a config.json) and return the model's parameter units and shape."""
    try:
        config = json.loads(Path(path).read_text())
    except OSError as exc:
        raise HFConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise HFConfigError(f"{path} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return spec_from_config(config, str(path))


def spec_from_config(config: dict[str, Any], where: str = "config") -> ModelSpec:
    _check_causal(config, where)
    kind = config.get("model_type")
    if kind in GPT2_TYPES:
        return _gpt2(_Fields(config, where))
    return _llama(_Fields(config, where))


def _check_causal(config: dict[str, Any], where: str) -> None:
    archs = config.get("architectures") or []
    if archs and not any(str(a).endswith(CAUSAL_SUFFIXES) for a in archs):
        raise HFConfigError(
            f"{where}: architectures {archs} is not a causal LM (none ends with "
            f"{' or '.join(CAUSAL_SUFFIXES)}); shardwise plan plans decoder-only language models")
    kind = config.get("model_type")
    if kind is None:
        raise HFConfigError(f"{where}: missing field 'model_type' (one of "
                            f"{', '.join(GPT2_TYPES + LLAMA_TYPES)})")
    if kind not in GPT2_TYPES + LLAMA_TYPES:
        raise HFConfigError(
            f"{where}: model_type {kind!r} is not a causal LM family shardwise plan knows; "
            f"known: {', '.join(GPT2_TYPES + LLAMA_TYPES)}")


class _Fields:
    """Typed reads of a config's fields, naming the field that is missing or wrong."""

    def __init__(self, config: dict[str, Any], where: str):
        self.config, self.where = config, where

    def int(self, name: str, default: int | None = None) -> int:
        value = self.config.get(name, default)
        if value is None:
            raise HFConfigError(f"{self.where}: missing field {name!r} "
                                f"(model_type {self.config.get('model_type')!r} needs it)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HFConfigError(f"{self.where}: field {name!r} must be a positive integer, "
                                f"got {value!r}")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.config.get(name, default)
        if not isinstance(value, bool):
            raise HFConfigError(f"{self.where}: field {name!r} must be true or false, "
                                f"got {value!r}")
        return value


def _linear(d_in: int, d_out: int, split: str | None, bias: bool) -> list[ParamSize]:
    """A Linear's weight (out x in) and bias; ``split``: 'out' (column-wise), 'in' (row-wise)."""
    dim = {"out": d_out, "in": d_in, None: None}[split]
    out = [ParamSize(d_in * d_out, dim)]
    if bias:
        out.append(ParamSize(d_out, d_out if split == "out" else None))
    return out


def _gpt2(f: _Fields) -> ModelSpec:
    h, n_layer, vocab = f.int("n_embd"), f.int("n_layer"), f.int("vocab_size")
    heads, positions = f.int("n_head"), f.int("n_positions")
    inner = f.int("n_inner", 4 * h) if f.config.get("n_inner") is not None else 4 * h
    if h % heads:
        raise HFConfigError(f"{f.where}: n_embd ({h}) is not divisible by n_head ({heads})")
    norm = [ParamSize(h), ParamSize(h)]
    layer = (norm + _linear(h, 3 * h, "out", True) + _linear(h, h, "in", True) + norm
             + _linear(h, inner, "out", True) + _linear(inner, h, "in", True))
    root = [ParamSize(vocab * h, vocab), ParamSize(positions * h, h), *norm]  # head tied
    shape = TransformerShape(n_layer, h, heads, heads, inner, vocab, "gelu", positions)
    return ModelSpec(f"GPT-2 style ({n_layer} layers, n_embd {h})",
                     [list(layer) for _ in range(n_layer)] + [root], shape)


def _llama(f: _Fields) -> ModelSpec:
    h, n_layer = f.int("hidden_size"), f.int("num_hidden_layers")
    vocab, inner, heads = f.int("vocab_size"), f.int("intermediate_size"), \
        f.int("num_attention_heads")
    kv = f.int("num_key_value_heads", heads)
    if heads % kv:
        raise HFConfigError(f"{f.where}: num_attention_heads ({heads}) is not divisible by "
                            f"num_key_value_heads ({kv})")
    head_dim = f.int("head_dim", h // heads) if f.config.get("head_dim") is not None \
        else h // heads
    qkv_bias = f.config.get("model_type") == "qwen2" or f.flag("attention_bias", False)
    mlp_bias = f.flag("mlp_bias", False)
    tied = f.flag("tie_word_embeddings", False)
    layer = ([ParamSize(h)] + _linear(h, heads * head_dim, "out", qkv_bias)
             + _linear(h, kv * head_dim, "out", qkv_bias) * 2
             + _linear(heads * head_dim, h, "in", f.flag("attention_bias", False))
             + [ParamSize(h)] + _linear(h, inner, "out", mlp_bias) * 2
             + _linear(inner, h, "in", mlp_bias))
    root = [ParamSize(vocab * h, vocab), ParamSize(h)]
    if not tied:
        root.append(ParamSize(vocab * h, vocab))
    positions = f.config.get("max_position_embeddings")
    shape = TransformerShape(n_layer, h, heads, kv, inner, vocab, "swiglu",
                             positions if isinstance(positions, int) else None)
    return ModelSpec(f"{f.config['model_type']} style ({n_layer} layers, hidden {h})",
                     [list(layer) for _ in range(n_layer)] + [root], shape)
