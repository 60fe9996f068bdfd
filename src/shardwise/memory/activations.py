"""Activation memory per rank of a decoder-only transformer: an estimate, before anything runs.

[Note: activation estimate]
Activations are the tensors autograd keeps from forward for backward. With ``b`` sequences per
rank, ``s`` tokens each, width ``h``, ``L`` layers, MLP width ``f``, vocabulary ``V`` and ``e``
bytes per element (4 in fp32, 2 in bf16 or mixed precision), a layer keeps, in units of
``b * s * h`` elements:

    GELU MLP (the demo GPT, GPT-2):   9 + 2 f / h
        block input, ln1 output, q k v (3), attention output, its re-laid-out copy (the
        projection's input), the residual sum (ln2's input), ln2 output; fc1 output and
        GELU output (f / h each)
    SwiGLU MLP (Llama style):         7 + 2 g + 4 f / h,   g = key/value heads / heads
        block input, norm output, rotated q, rotated k and v (g each), attention output and
        its copy, residual sum, norm output; gate, up, SiLU(gate) and their product (f / h each)

Attention is assumed fused (flash or memory-efficient SDPA: no ``s x s`` score matrix is kept,
only a per-row log-sum-exp, which is ignored). On top of the layers come the final norm's input
and output (``2 b s h``) and the loss: the logits, their log-softmax and, as backward starts,
the gradient of the log-softmax (``3 b s V`` elements, in fp32 as the loss computes it).

    no checkpointing:  e b s h (L c + 2)  +  4 * 3 b s V
    checkpointing:     e b s h L  +  max(e b s h 2 + 4 * 3 b s V,  e b s h (c + f / h + 1))

Without checkpointing the peak comes as backward starts: every layer's tensors and the loss's.
With activation checkpointing of every layer, each layer keeps only its input; the peak is
either that start of backward, or later the recomputation of one layer, which holds its ``c``
tensors again plus the gradients flowing through it (``f / h + 1``). Under tensor parallelism
of degree ``t`` (Megatron style, as `--strategy tp` splits the demo GPT), the tensors inside
attention and the MLP are split across the ``t`` ranks and the four at the layer's edges (block
input, norm outputs, residual sum) are not: ``c = 4 + (c - 4) / t``; the loss terms stay whole
(the head's output is gathered). Everything here is an
estimate: allocator caching, temporary buffers inside kernels and the gradients flowing
backward come on top or overlap; tests/memory checks it against measured peak allocation of
the demo GPT on CPU at two batch sizes (within 20%).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerShape:
    """The dimensions of a decoder-only transformer that set its activation memory."""

    n_layer: int
    d_model: int
    n_head: int
    kv_heads: int
    ffn: int  # MLP hidden width
    vocab: int
    mlp: str = "gelu"  # "gelu" (two-matrix MLP) or "swiglu" (gate, up, down)
    max_seq: int | None = None


def per_layer_factor(shape: TransformerShape, tp: int = 1) -> float:
    """Elements one layer keeps for backward, per token and per unit of width (``c``)."""
    ratio = shape.ffn / shape.d_model
    if shape.mlp == "gelu":
        c = 9 + 2 * ratio
    elif shape.mlp == "swiglu":
        c = 7 + 2 * shape.kv_heads / shape.n_head + 4 * ratio
    else:
        raise ValueError(f"unknown MLP kind {shape.mlp!r}; known: gelu, swiglu")
    return 4 + (c - 4) / tp


def activation_bytes(shape: TransformerShape, batch: int, seq: int, *, elem_bytes: int = 4,
                     checkpointing: bool = False, tp: int = 1) -> int:
    """Peak activation bytes of one rank running ``batch`` sequences of ``seq`` tokens; see
    [Note: activation estimate]. A pure function."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and sequence length must be at least 1, got {batch}, {seq}")
    if shape.max_seq is not None and seq > shape.max_seq:
        raise ValueError(f"sequence length {seq} is longer than the model's {shape.max_seq}")
    tokens = batch * seq
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    c = per_layer_factor(shape, tp)
    unit = elem_bytes * tokens * shape.d_model  # bytes of one (b, s, h) tensor
    start_of_backward = 2 * unit + 4 * 3 * tokens * shape.vocab  # final norm; the loss's
    if not checkpointing:
        return int(round(shape.n_layer * c * unit + start_of_backward))
    recompute = (c + shape.ffn / shape.d_model / tp + 1) * unit
    return int(round(shape.n_layer * unit + max(start_of_backward, recompute)))
