"""Bucket.piece / owned_pieces / show_full / show_shard (zeroplus/zero/layout.py) on one process:
the one place the shard intersection is computed, and the only writers of a managed .data."""

from __future__ import annotations

import torch

from zeroplus.zero.layout import Bucket, Entry


def _bucket(world: int = 3):
    # Three parameters, an alignment gap of 2 after the first, padding at the end: 5 + 2 + 4 + 6 = 17
    # used elements, padded to 18 = 3 shards of 6.
    ps = [torch.nn.Parameter(torch.arange(n, dtype=torch.float32).reshape(shape))
          for n, shape in ((5, (5,)), (4, (2, 2)), (6, (3, 2)))]
    entries = [Entry(ps[0], 0, 5, ps[0].shape), Entry(ps[1], 7, 4, ps[1].shape), Entry(ps[2], 11, 6, ps[2].shape)]
    return Bucket(index=0, group=0, dtype=torch.float32, device=torch.device("cpu"), numel=18, shard_numel=6,
                  used=15, entries=entries), ps


def test_pieces_cover_every_parameter_element_exactly_once_and_skip_gaps():
    b, _ = _bucket()
    covered = []
    for rank in range(3):
        for e_index, lo, hi in b.owned_pieces(rank):
            e = b.entries[e_index]
            pc = b.piece(e, rank)
            assert (pc.shard_lo, pc.shard_hi) == (lo, hi) and pc.numel == hi - lo > 0
            start = rank * b.shard_numel
            # the same elements seen from the bucket and from the parameter
            assert start + lo - e.offset == pc.param_lo and start + hi - e.offset == pc.param_hi
            covered += [(e_index, i) for i in range(pc.param_lo, pc.param_hi)]
    expected = [(i, k) for i, e in enumerate(b.entries) for k in range(e.numel)]
    assert sorted(covered) == expected
    assert b.owned_pieces(0) == [(0, 0, 5)]                  # the gap [5, 7) belongs to nobody
    assert b.owned_pieces(1) == [(1, 1, 5), (2, 5, 6)]       # the second parameter, then the third's head
    assert b.piece(b.entries[0], 2).numel == 0               # not in rank 2's shard


def test_show_full_and_show_shard_swap_what_the_module_sees():
    b, ps = _bucket()
    b.flat = torch.arange(18, dtype=torch.float32)
    b.show_full()
    assert ps[1].shape == (2, 2) and ps[1].data.data_ptr() == b.flat[7:].data_ptr()
    b.shard = torch.arange(6, 12, dtype=torch.float32)  # rank 1's shard
    b.show_shard(1)
    assert ps[0].numel() == 0 and ps[1].tolist() == [7.0, 8.0, 9.0, 10.0] and ps[2].tolist() == [11.0]
    b.show_full()
    b.show_shard(1)  # the cached views are reused while the shard is the same tensor
    assert ps[2].data.data_ptr() == b.shard[5:].data_ptr()
