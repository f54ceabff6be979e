"""routing_metadata against a plain per-expert listing of the slots."""

import numpy as np
import pytest

import moefuse


def _reference(ids, E, block, emap=None):
    M, k = ids.shape
    local = np.full(M * k, -1)
    for s, g in enumerate(ids.reshape(-1)):
        if emap is None:
            local[s] = g if 0 <= g < E else -1
        elif 0 <= g < len(emap) and 0 <= emap[g] < E:
            local[s] = emap[g]
    counts = np.array([(local == e).sum() for e in range(E)], dtype=np.int32)
    padded = (counts + block - 1) // block * block
    offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    order = np.full(M * k + E * (block - 1), -1, dtype=np.int32)
    position = np.full(M * k, -1, dtype=np.int32)
    row = np.full(M * k, -1, dtype=np.int32)
    for e in range(E):
        slots = np.flatnonzero(local == e)
        order[offsets[e]:offsets[e] + len(slots)] = slots
        position[slots] = offsets[e] + np.arange(len(slots))
        row[slots] = np.arange(len(slots))
    return counts, offsets, order, position.reshape(M, k), row.reshape(M, k)


@pytest.mark.parametrize("block", [1, 16, 5])
@pytest.mark.parametrize("mapped", [False, True])
def test_routing_metadata(ctx, rng, block, mapped):
    M, k, E = 19, 4, 8
    emap = None
    if mapped:
        emap = rng.integers(-1, E + 1, size=24).astype(np.int32)
        ids = rng.integers(-2, 26, size=(M, k)).astype(np.int32)
    else:
        ids = rng.integers(-2, E + 2, size=(M, k)).astype(np.int32)
    got = moefuse.routing_metadata(ids, E, block_size=block, expert_map=emap, ctx=ctx)
    want = _reference(ids, E, block, emap)
    for g, w in zip(got, want):
        assert g.dtype == np.int32
        np.testing.assert_array_equal(g, w)


def test_block_size_is_checked(ctx):
    ids = np.zeros((2, 2), dtype=np.int32)
    with pytest.raises(moefuse.InvalidArgumentError, match="block_size"):
        moefuse.routing_metadata(ids, 4, block_size=0, ctx=ctx)
