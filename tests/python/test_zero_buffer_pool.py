"""zeroplus/zero/buffer_pool.py: reuse of released bucket/gather buffers. Single process."""

import torch
from torch import nn

from zeroplus.zero.buffer_pool import BufferPool


def test_a_released_buffer_serves_the_next_take_of_the_same_size():
    pool = BufferPool()
    a = pool.take(1000, torch.float32, "cpu")
    ptr = a.data_ptr()
    pool.give(a)
    del a
    assert pool.pooled_bytes == 4000 and pool.taken_bytes == 0
    b = pool.take(1000, torch.float32, "cpu")
    assert b.data_ptr() == ptr and pool.reused == 1 and pool.pooled_bytes == 0
    # Another size or dtype never gets it.
    pool.give(b)
    c = pool.take(1000, torch.bfloat16, "cpu")
    assert c.data_ptr() != ptr and c.dtype == torch.bfloat16


def test_a_buffer_something_still_aliases_is_never_reused():
    pool = BufferPool()
    a = pool.take(64, torch.float32, "cpu")
    a.fill_(1.0)
    view = a[8:16]           # e.g. an activation saved by autograd
    param = nn.Parameter(torch.zeros(4))
    param.data = a[0:4]      # a parameter still pointing into it
    pool.give(a)
    assert pool.pooled_bytes == 0
    b = pool.take(64, torch.float32, "cpu")
    assert b.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    b.fill_(7.0)
    assert bool(view.eq(1.0).all()) and bool(param.data.eq(1.0).all())  # untouched by b's user
    # The same holds for a tensor object shared with C++ (a collective's work keeps one).
    held = torch.empty(0)
    c = pool.take(32, torch.float32, "cpu")
    held.set_(c)             # another TensorImpl on the same storage
    pool.give(c)
    assert pool.pooled_bytes == 0


def test_taken_plus_pooled_never_exceeds_the_peak_in_use():
    pool = BufferPool()
    small = [pool.take(100, torch.float32, "cpu") for _ in range(3)]  # peak 1200 bytes
    assert pool.peak_bytes == 1200
    for t in small:
        pool.give(t)
    del small, t
    assert pool.pooled_bytes == 1200
    # A new size: 1000 bytes taken, so at most 200 may stay pooled; buffers go whole (400 each).
    big = pool.take(250, torch.float32, "cpu")
    assert pool.taken_bytes == 1000 and pool.pooled_bytes == 0 and pool.peak_bytes == 1200
    pool.give(big)
    del big
    assert pool.taken_bytes + pool.pooled_bytes <= pool.peak_bytes
    pool.clear()
    assert pool.pooled_bytes == 0


def test_a_forgotten_buffer_no_longer_counts_as_taken():
    # A failed pass drops its buffers without giving them back; the peak must not grow by them.
    pool = BufferPool()
    lost = pool.take(100, torch.float32, "cpu")
    pool.forget(lost)
    del lost
    assert pool.taken_bytes == 0 and pool.pooled_bytes == 0
    a = pool.take(100, torch.float32, "cpu")
    assert pool.peak_bytes == 400 and pool.taken_bytes == 400
    pool.give(a)
    del a
    assert pool.pooled_bytes == 400
