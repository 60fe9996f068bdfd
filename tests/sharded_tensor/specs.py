"""Specs used across the sharded tensor tests, for a given world size (uneven on purpose)."""

from shardwise.sharded_tensor import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata

SIZE = (7, 5)  # 7 rows and 5 columns: uneven over 2 and 4 ranks (5 over 4 leaves one empty)


def rows(ws):
    return ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(ws)])


def cols(ws):
    return ChunkShardingSpec(1, list(range(ws)))


def rows_reversed(ws):
    return ChunkShardingSpec(0, [f"rank:{r}" for r in reversed(range(ws))])


def grid(ws):
    """Four boxes of SIZE placed round-robin (several shards per rank below 4 ranks)."""
    boxes = [((0, 0), (3, 2)), ((0, 2), (3, 3)), ((3, 0), (4, 4)), ((3, 4), (4, 1))]
    return EnumerableShardingSpec([ShardMetadata(o, s, f"rank:{i % ws}/cpu")
                                   for i, (o, s) in enumerate(boxes)])


ALL = {"rows": rows, "cols": cols, "rows_reversed": rows_reversed, "grid": grid}
