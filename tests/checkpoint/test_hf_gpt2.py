"""A Hugging Face GPT-2 (built from a tiny config: no download) under our fully_shard, one unit
per block: trained 2 steps at world size 2, saved, loaded at world size 1 (model and AdamW
state equal the saved ones exactly), exported to safetensors and read back by
``safetensors.torch.load_file`` with the trained parameters exactly (tied head included), and
accepted by the plain model's ``load_state_dict(strict=True)``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.harness import rank_slice, run_on_ranks

pytestmark = pytest.mark.slow  # every rank imports transformers (minutes): `pytest -m slow`

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[test]')")
safetensors_torch = pytest.importorskip("safetensors.torch")

BATCH, SEQ, VOCAB = 8, 16, 64


def _config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                   n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _model(ctx, seed: int):
    from shardwise import fully_shard

    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(_config())
    if ctx is not None:
        for block in model.transformer.h:
            fully_shard(block, process_group=ctx.group)
        fully_shard(model, process_group=ctx.group)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state tensor whole (DTensor.full_tensor: an all-gather)."""
    def whole(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {}
    for name, p in model.named_parameters():
        out[name] = whole(p)
        for key, value in opt.state[p].items():
            out[f"{name}.{key}"] = whole(value)
    return out


def _train_and_save(ctx, path: str):
    from shardwise.checkpoint import get_state_dict, save

    model, opt = _model(ctx, seed=0)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        ids = rank_slice(ids, ctx.rank, ctx.world_size)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, opt)
    save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=ctx.group)
    full = _full(model, opt)
    return full if ctx.rank == 0 else None


def _load(ctx, path: str):
    from shardwise.checkpoint import get_state_dict, load, set_state_dict

    model, opt = _model(ctx, seed=1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    load(state, checkpoint_id=path, process_group=ctx.group, strict=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = _full(model, opt)
    dist.barrier(ctx.group)
    return full if ctx.rank == 0 else None


def test_hf_gpt2_round_trip_to_another_world_size_and_export(tmp_path):
    from shardwise.checkpoint import export_safetensors

    path = str(tmp_path / "ck")
    trained = run_on_ranks(2, _train_and_save, path)[0]
    # one more world size only: every rank process imports transformers (seconds each)
    loaded = run_on_ranks(1, _load, path)[0]
    assert loaded.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key
    out = tmp_path / "gpt2.safetensors"
    export_safetensors(path, out)
    exported = safetensors_torch.load_file(str(out))
    plain = transformers.GPT2LMHeadModel(_config())
    assert exported.keys() == plain.state_dict().keys()
    for name, _ in plain.named_parameters():
        assert torch.equal(exported[name], trained[name]), name
    assert torch.equal(exported["lm_head.weight"], trained["transformer.wte.weight"])  # tied
    plain.load_state_dict(exported, strict=True)
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name
