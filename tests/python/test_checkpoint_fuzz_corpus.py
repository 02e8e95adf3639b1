"""The checkpoint manifest fuzz target's corpus, replayed without atheris (issue 25): every seed
and every regression input of tests/fuzz/corpus/checkpoint_manifest_fuzz/ goes through
check_one (parse, decode, read and verify everything: only CheckpointError may come out), and
each bug the fuzzer found is pinned by the error its input must now give. Single process."""

from __future__ import annotations

import contextlib
import os
import pathlib
import resource
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fuzz"))

import checkpoint_manifest_fuzz as target  # noqa: E402
from zeroplus.checkpoint import format as fmt  # noqa: E402

CORPUS = HERE.parent / "fuzz" / "corpus" / "checkpoint_manifest_fuzz"
INPUTS = sorted(p.name for p in CORPUS.iterdir())


@pytest.mark.parametrize("name", INPUTS)
def test_corpus_input_gives_a_result_or_a_checkpoint_error(name):
    target.check_one((CORPUS / name).read_bytes())


@pytest.mark.parametrize("seed", ["seed-manifest-and-shard", "seed-sealed-manifest-and-shard"])
def test_the_real_seed_reads_and_verifies_without_error(seed):
    manifest, _sep, shard = (CORPUS / seed).read_bytes().partition(target.SEPARATOR)
    m = target.parse(manifest)
    d = target.write_checkpoint(m, manifest, shard)
    target.consolidate_path(d, m)  # each raises on any error: the seed is a valid checkpoint
    target.inspect_path(d, m)


@contextlib.contextmanager
def _address_space(extra_bytes: int):
    """At most extra_bytes more address space: a huge allocation fails (RuntimeError) instead of
    succeeding untouched under overcommit, as it would on a machine with less memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + extra_bytes if hard == resource.RLIM_INFINITY
                                            else min(hard, used + extra_bytes), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("name, step, error, words", [
    # torch.empty(numel) of a shape past int64 raised TypeError from the reader. Its dimension is
    # itself past int64: the validator's JSON (C++, int64 integers) refuses it as corrupt now
    ("regression-shape-overflows-int64", "parse", fmt.CheckpointCorruptError, "integer out of the int64 range"),
    # json.loads' RecursionError escaped parse_manifest
    ("regression-deep-nesting", "parse", fmt.CheckpointCorruptError, "not valid JSON"),
    # the consolidate/inspect path raised a plain OSError for a tensor no chunk holds
    ("regression-no-shard-holds-tensor", "consolidate_path", fmt.CheckpointCorruptError, "no shard holds"),
    # two chunks storing the same elements made the reader's coverage count hide a gap: it
    # returned uninitialised memory for elements no chunk holds, without an error
    ("regression-overlapping-chunks", "parse", fmt.CheckpointError, "overlap"),
    # a manifest claiming a 512 GiB tensor in a 512 GiB file (the real one is 384 bytes): the
    # reader allocated the claimed size before checking the file's real size. Its 512 GiB
    # checksum block is refused by the parser now (issue 40 item 8: block_bytes is bounded)
    ("regression-claimed-size-allocated-first", "parse", fmt.CheckpointError, "block_bytes 549755813888 is outside"),
    # a 512 GiB tensor no chunk holds: consolidate/inspect allocated zeros of its size (RuntimeError,
    # or the memory itself) before saying no shard holds it
    ("regression-unstored-tensor-allocated-first", "consolidate_path", fmt.CheckpointCorruptError,
     "no shard holds 'unstored'"),
    # a block checksum past 32 bits passed the parser (any int) and reached the C++ verified read,
    # which refused it as a bad argument (ValueError) instead of a corrupt manifest
    ("regression-block-crc-past-32-bits", "parse", fmt.CheckpointError, "each a 32-bit unsigned integer"),
])
def test_regression_inputs_give_the_documented_error(name, step, error, words):
    manifest, _sep, shard = (CORPUS / name).read_bytes().partition(target.SEPARATOR)
    with _address_space(4 << 30), pytest.raises(error, match=words):
        m = target.parse(manifest)
        getattr(target, step)(target.write_checkpoint(m, manifest, shard), m)
