"""Bucket.piece / owned_pieces / show_full / show_resting (zeroplus/zero/layout.py) on one process:
the one place the shard intersection is computed, and the only writers of a managed .data."""

from __future__ import annotations

import pytest
import torch

from zeroplus.zero.layout import Bucket, Entry, is_resting, resting_view


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


def test_show_full_and_show_resting_swap_what_the_module_sees():
    b, ps = _bucket()
    b.flat = torch.arange(18, dtype=torch.float32)
    b.show_full()
    assert ps[1].shape == (2, 2) and ps[1].data.data_ptr() == b.flat[7:].data_ptr()
    b.shard = torch.arange(6, 12, dtype=torch.float32)  # rank 1's shard
    b.flat = None
    b.show_resting()
    # Full shape, dtype and device as under DDP; no values (NaN), no memory; the shard is untouched.
    assert [tuple(p.shape) for p in ps] == [(5,), (2, 2), (3, 2)] and sum(p.numel() for p in ps) == 15
    assert all(torch.isnan(p).all() and is_resting(p.data, p.shape) for p in ps)
    assert ps[1].data.untyped_storage().nbytes() == 4 and b.shard.tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    assert b.stray_at_rest() is None and b.stray_param() is None


def test_a_resting_parameter_changed_by_the_user_is_found_not_dropped():
    # torch refuses most in-place writes into a resting view (one element behind many) ...
    b, ps = _bucket()
    b.shard = torch.zeros(6)
    b.show_resting()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
            ps[1].mul_(2)
        # ... the ones it allows are found: through the parameter's version counter
        torch.nn.init.zeros_(ps[1])
    stray = b.stray_at_rest()
    assert stray is not None and stray.param is ps[1] and stray.how == "written"
    b.show_resting()
    ps[2].data.fill_(1.0)  # through .data (no version bump): the shared element's value (CPU)
    stray = b.stray_at_rest()
    assert stray is not None and stray.how == "written"
    resting_view((1,), torch.float32, "cpu").fill_(float("nan"))  # repair the shared element
    b.show_resting()
    ps[0].data = torch.zeros(5)  # replaced (model.to(...), p.data = ...)
    stray = b.stray_at_rest()
    assert stray is not None and stray.param is ps[0] and stray.how == "replaced"
    assert b.stray_param() is ps[0]
