"""The demo workload's data: Python's standard library sources as a byte-level corpus."""

from shardwise.data.batches import BatchStream, TokenWindows
from shardwise.data.corpus import Corpus, load_corpus, stdlib_sources
from shardwise.data.sampler import DistributedSampler

__all__ = [
    "BatchStream",
    "Corpus",
    "DistributedSampler",
    "TokenWindows",
    "load_corpus",
    "stdlib_sources",
]
