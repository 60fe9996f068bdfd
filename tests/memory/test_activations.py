"""The activation estimate against the peak memory a forward + backward of the demo GPT really
allocates on CPU, at two batch sizes, with and without activation checkpointing.

The measurement is torch's profiler with ``profile_memory=True``: every CPU allocation and free
in time order, summed into live bytes, whose maximum is the peak growth over what existed
before forward (the model, and gradients allocated beforehand so that backward adds none).
Unlike RSS, it is not blurred by the allocator keeping freed blocks.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from shardwise.memory.activations import TransformerShape, activation_bytes, per_layer_factor
from shardwise.models import GPT, GPTConfig, lm_loss

# Activations dominate: 4 x 64 x 64 tokens x width per layer against 50k parameters per layer.
CFG = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=64)
# Fewer layers and a wider vocabulary: the loss's share of the peak is larger.
WIDE_VOCAB = GPTConfig(vocab_size=1024, seq_len=32, n_layer=2, n_head=2, d_model=96)


def _shape(cfg):
    return TransformerShape(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_head,
                            cfg.mlp_ratio * cfg.d_model, cfg.vocab_size, "gelu", cfg.seq_len)


def _peak_growth(model, batch):
    cfg = model.cfg
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _model(cfg, checkpointed):
    torch.manual_seed(0)
    model = GPT(cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # backward accumulates in place: no new gradient memory
    if checkpointed:
        for block in model.blocks:
            plain = block.forward
            block.forward = lambda x, f=plain: checkpoint(f, x, use_reentrant=False)
    return model


@pytest.mark.parametrize("cfg", (CFG, WIDE_VOCAB), ids=("demo", "wide-vocab"))
@pytest.mark.parametrize("checkpointed", (False, True))
def test_estimate_is_within_20_percent_of_measured_peak_at_two_batch_sizes(cfg, checkpointed):
    torch.set_num_threads(1)
    model = _model(cfg, checkpointed)
    for batch in (2, 8):
        measured = _peak_growth(model, batch)
        est = activation_bytes(_shape(cfg), batch, cfg.seq_len, checkpointing=checkpointed)
        assert measured == pytest.approx(est, rel=0.20), (batch, measured, est)


def test_checkpointing_and_tensor_parallelism_shrink_the_layers_part():
    shape = _shape(CFG)
    assert per_layer_factor(shape) == 9 + 2 * 4
    assert per_layer_factor(shape, tp=2) == 4 + 13 / 2
    plain = activation_bytes(shape, 4, 64)
    assert activation_bytes(shape, 8, 64) == 2 * plain  # linear in the batch
    assert activation_bytes(shape, 4, 64, checkpointing=True) < plain
    assert activation_bytes(shape, 4, 64, tp=2) < plain
    swiglu = TransformerShape(2, 64, 8, 2, 172, 100, "swiglu")
    assert per_layer_factor(swiglu) == 7 + 2 * 2 / 8 + 4 * 172 / 64
    with pytest.raises(ValueError, match="longer than the model's 64"):
        activation_bytes(shape, 1, 65)
    with pytest.raises(ValueError, match="unknown MLP kind 'relu'"):
        per_layer_factor(TransformerShape(1, 8, 1, 1, 8, 8, "relu"))
