"""The checkpoint manifest fuzz target's corpus, replayed without atheris (issue 25): every seed
and every regression input of tests/fuzz/corpus/checkpoint_manifest_fuzz/ goes through
check_one (parse, decode, read and verify everything: only CheckpointError may come out), and
each bug the fuzzer found is pinned by the error its input must now give. Single process."""

from __future__ import annotations

import os
import pathlib
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


def test_the_real_seed_reads_and_verifies_without_error(tmp_path):
    data = (CORPUS / "seed-manifest-and-shard").read_bytes()
    manifest, _sep, shard = data.partition(target.SEPARATOR)
    m = fmt.parse_manifest(manifest, "seed")
    target._decode_all(m)
    target._read_all(m, manifest, shard)  # raises on any error: the seed is a valid checkpoint


@pytest.mark.parametrize("name, error, words", [
    # torch.empty(numel) of a shape past int64 raised TypeError from the reader
    ("regression-shape-overflows-int64", fmt.CheckpointError, "invalid shape"),
    # json.loads' RecursionError escaped parse_manifest
    ("regression-deep-nesting", fmt.CheckpointCorruptError, "not valid JSON"),
    # the consolidate/inspect path raised a plain OSError for a tensor no chunk holds
    ("regression-no-shard-holds-tensor", fmt.CheckpointCorruptError, "no shard holds"),
    # two chunks storing the same elements made the reader's coverage count hide a gap: it
    # returned uninitialised memory for elements no chunk holds, without an error
    ("regression-overlapping-chunks", fmt.CheckpointError, "overlap"),
])
def test_regression_inputs_give_the_documented_error(name, error, words):
    data = (CORPUS / name).read_bytes()
    manifest, _sep, shard = data.partition(target.SEPARATOR)
    with pytest.raises(error, match=words):
        m = fmt.parse_manifest(manifest, "regression")
        target._decode_all(m)
        target._read_all(m, manifest, shard)


def teardown_module():
    if target._scratch is not None:
        for n in os.listdir(target._scratch):
            os.unlink(os.path.join(target._scratch, n))
        os.rmdir(target._scratch)
