"""The second file of the RPC program in test_rpc_program_files.py: its models and helpers, in
the shape of pytorch/examples' distributed RNN (``rnn.py`` beside ``main.py``). Peers name these
functions and classes (``rpc_program_parts:_call_method``, ``EmbeddingTable.forward``, ...);
torch resolves anything, shardwise resolves them as the program's own code ([Note: allow-list]
rule 2 in shardwise/rpc/trust/callables.py), the two private helpers that peers call once registered
(the block at the end: rule 2 leaves a program module's private names to registration).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

# the program's one line that differs between the two runs: the import
if sys.argv[1:2] == ["shardwise"]:
    import shardwise.rpc as rpc
else:
    import torch.distributed.rpc as rpc


def _init_from(module: nn.Module, seed: int) -> None:
    """Seeded weights whichever RPC thread builds the module (no global RNG shared)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref] + list(args),
                        kwargs=kwargs)


def _parameter_rrefs(module: nn.Module) -> list:
    return [rpc.RRef(p) for p in module.parameters()]


def make_batch(seed: int, ntoken: int, steps: int, batch: int) -> tuple:
    """Inputs and targets for one step, made on the worker that is asked."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, ntoken, (steps, batch), generator=gen)
    return data, torch.randint(0, ntoken, (steps, batch), generator=gen)


def make_batch_np(seed: int, ntoken: int, steps: int, batch: int) -> tuple:
    """``make_batch``'s inputs and targets as numpy arrays (as the RL example's states travel)."""
    data, target = make_batch(seed, ntoken, steps, batch)
    return data.numpy(), target.numpy()


class ModelStore:
    """Lives on the parameter server: builds a model of a library (``visionlike``, a module
    outside the program's directories, as torchvision is) and hands it out through a method
    called on its RRef, as the batch parameter server's ``get_model`` does."""

    def __init__(self, seed: int):
        import visionlike

        self.model = visionlike.make(seed)

    def get_model(self) -> nn.Module:
        return self.model


class EmbeddingTable(nn.Module):
    """Lives on the parameter server."""

    def __init__(self, ntoken: int, ninp: int, seed: int):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        _init_from(self, seed)

    def forward(self, input):
        return self.encoder(input)

    def weight_norm(self) -> torch.Tensor:
        return self.encoder.weight.detach().norm()


class Decoder(nn.Module):
    """Lives on the parameter server."""

    def __init__(self, ntoken: int, nhid: int, seed: int):
        super().__init__()
        self.decoder = nn.Linear(nhid, ntoken)
        _init_from(self, seed)

    def forward(self, output):
        return self.decoder(output)


class RNNModel(nn.Module):
    """Embedding and decoder on the parameter server, the LSTM here."""

    def __init__(self, ps: str, ntoken: int, ninp: int, nhid: int, nlayers: int):
        super().__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, 1))
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        _init_from(self.rnn, 2)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, 3))

    def forward(self, input, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self) -> list:
        remote_params = []
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        remote_params.extend(_parameter_rrefs(self.rnn))
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params


if sys.argv[1:2] == ["shardwise"]:  # the private helpers peers call (torch serves any name)
    rpc.register(_call_method)
    rpc.register(_parameter_rrefs)
