"""The migration pages run (issue 38 item 4): docs/from_ddp.md, docs/from_fsdp2.md and
docs/from_deepspeed.md show a complete script for DDP / FSDP2 / DeepSpeed and the same script on
zeroplus. Every fenced python block marked `<!-- run: PAGE/NAME -->` is extracted from the page
and executed as it is, as `torchrun --nproc_per_node 2` would run it: 2 ranks, each with RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment (a
fresh port per script), `__name__ == "__main__"`, its working directory a fresh folder shared by
the two ranks. The scripts create and destroy their own default process group (env://), so one
2-rank launch runs them one after the other. What is compared is what the scripts write:

* from_ddp: the DDP script against the zeroplus script at stage=1, 2, 3 (the test replaces the
  stage number, nothing else): rank 0's saved `model.pt` equal to 1e-5 (fp32), the reference moved
  more than that; at stage 3 the big parameters really are shards between steps (the page's model
  is sized so the default persistence threshold shards them). Also with `USE_BF16 = True`
  (autocast) at stage 2: within a quarter of how far the reference moved.
* from_fsdp2: the FSDP2 script and its zeroplus stage-3 version each train from scratch and
  save a DCP checkpoint (their own `get_state_dict`); then each resumes from the OTHER's
  checkpoint and trains on. Model weights and optimizer state in the checkpoints, read back with
  torch's `dcp_to_torch_save`, equal to 1e-5 at both points.
* from_deepspeed: DeepSpeed 0.19.8 (CPU, gloo) and the zeroplus script on the same ds_config, its
  zero_optimization stage 2 as on the page and replaced by 1 and 3 (one launch per stage:
  DeepSpeed keeps its groups in module globals); both checkpoints are loaded with
  zeroplus.load_checkpoint into a fresh stage-2 model and their full state dicts compared to 1e-5.
* the printed losses (and, in from_ddp, torch's clip_grad_norm_ results) of each pair are equal
  step by step; the DDP save line kept at stage 2 works, at stage 3 raises naming
  zeroplus.full_state_dict; torch's DCP get_state_dict kept on zeroplus raises naming ours.
* every `<!-- diff: A B -->` block, applied to block A hunk by hunk (each run of `-` lines
  replaced by the `+` lines after it), gives block B exactly.

A doc block that stops matching the product fails here: it raises, or its weights differ.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket

import pytest
import torch

from harness import run_distributed

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGES = ("from_ddp", "from_fsdp2", "from_deepspeed")
_MARK = re.compile(r"<!-- (run|diff): ([^>]*?) -->\n```(\w+)\n(.*?)```", re.S)


def _blocks():
    """{("run", "page/name"): source} and {("diff", "a b"): diff text} of the three pages."""
    out = {}
    for page in PAGES:
        text = (REPO / "docs" / f"{page}.md").read_text()
        for kind, name, lang, body in _MARK.findall(text):
            want = "python" if kind == "run" else "diff"
            assert lang == want, f"docs/{page}.md: the block after <!-- {kind}: {name} --> is ```{lang}, not ```{want}"
            assert (kind, name) not in out, f"docs/{page}.md: two blocks named {name}"
            out[(kind, name)] = body
    return out


BLOCKS = _blocks()


def _source(name: str, replace: dict[str, str] | None = None) -> str:
    """The block's source, with each `old` of `replace` (exactly one occurrence) replaced."""
    src = BLOCKS[("run", name)]
    for old, new in (replace or {}).items():
        assert src.count(old) == 1, f"{name}: expected one {old!r} to replace, found {src.count(old)}"
        src = src.replace(old, new)
    return src


def _port(rank: int, workdir: str) -> int:
    """A free port for the script's MASTER_PORT, chosen by rank 0 just before the script starts
    (the machine is shared: a port picked long before could be taken) and handed to the other
    ranks through a file in the shared working directory."""
    import time

    path = os.path.join(workdir, "master_port")
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(path + ".tmp", "w") as f:
            f.write(str(port))
        os.rename(path + ".tmp", path)
        return port
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 wrote no {path}")
        time.sleep(0.02)
    with open(path) as f:
        return int(f.read())


# -- inside a rank -----------------------------------------------------------------------------

def _exec_script(rank, world, label, source, workdir, port):
    """Runs one doc script as torchrun would start it on this rank; returns its namespace and
    what it printed."""
    import contextlib
    import io

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(workdir)
    namespace, printed = {"__name__": "__main__"}, io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(source, f"<docs {label}>", "exec"), namespace)  # noqa: S102 - the page's own script
    finally:
        if dist.is_initialized():  # a script that raised: leave no group behind for the next one
            dist.destroy_process_group()
    return namespace, printed.getvalue()


def _ranks(rank, world, plan):
    """Runs the plan's entries in order: {label, source, workdir, what, copy_from}; what:
    None, "sharded" (return the stage-3 engine's sharded parameters), "initial" (return the
    page's TinyLM at the script's seed), "ds_load" (_load_both). copy_from: a folder whose
    checkpoint/ rank 0 copies into workdir first (atomically: the other rank waits for it)."""
    import importlib
    import shutil
    import time

    os.environ["DS_ACCELERATOR"] = "cpu"
    out = {}
    for e in plan:
        label, workdir = e["label"], e["workdir"]
        if e.get("copy_from"):
            target = os.path.join(workdir, "checkpoint")
            if rank == 0:
                shutil.copytree(os.path.join(e["copy_from"], "checkpoint"), target + ".tmp")
                os.rename(target + ".tmp", target)
            deadline = time.monotonic() + 120
            while not os.path.isdir(target):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{target} did not appear")
                time.sleep(0.05)
        port = _port(rank, workdir)
        if e["what"] == "ds_load":
            out[label] = _load_both(rank, world, e["source"], e["dirs"], port)
            continue
        if "deepspeed/deepspeed" in label:
            # DeepSpeed's CPU backend JIT-compiles a shared-memory allreduce op (C++, minutes on two
            # cores) that only its inference all-reduce uses; training goes through gloo.
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        if e.get("raises"):  # (ranks, pattern): the script must raise RuntimeError there, naming the call to use
            ranks, pattern = e["raises"]
            try:
                _exec_script(rank, world, label, e["source"], workdir, port)
                out[label] = None
            except RuntimeError as error:
                if rank not in ranks or not re.search(pattern, str(error)):
                    raise
                out[label] = str(error)
            continue
        ns, printed = _exec_script(rank, world, label, e["source"], workdir, port)
        out[f"{label} printed"] = printed
        if e["what"] == "sharded":
            from sharding import sharded_names
            out[label] = sharded_names(ns["model"], ns["opt"])
        elif e["what"] == "initial":
            with torch.random.fork_rng():
                torch.manual_seed(0)  # the script's seed, before its model
                out[label] = {k: v.detach().clone() for k, v in ns["TinyLM"]().state_dict().items()}
    return out


def _load_both(rank, world, source, dirs, port):
    """Loads the DeepSpeed and the zeroplus checkpoint of from_deepspeed with zeroplus.load_checkpoint
    into fresh stage-2 models built by the page's own definitions; returns rank 0's full weights."""
    import torch.distributed as dist

    import zeroplus

    namespace = {}
    definitions = source.split("\nds_config = {")[0]  # imports, TinyLM, batch
    exec(compile(definitions, "<docs from_deepspeed definitions>", "exec"), namespace)  # noqa: S102
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("zeroplus")
    try:
        weights = {}
        for key, directory in dirs.items():
            torch.manual_seed(1)  # other initial values than the scripts': the load must overwrite them
            model, opt = zeroplus.initialize(namespace["TinyLM"](), torch.optim.AdamW, stage=2, lr=0.5)
            zeroplus.load_checkpoint(os.path.join(directory, "checkpoints"), model, opt)
            weights[key] = zeroplus.full_state_dict(model)
        return weights
    finally:
        dist.destroy_process_group()


# -- the launch --------------------------------------------------------------------------------

DDP_STAGES = (1, 2, 3)
DS_STAGES = (1, 2, 3)
ZEROPLUS_SAVE = ('sd = zeroplus.full_state_dict(model)      # collective: every rank calls it (rank 0 gets the dict)\n'
                 'if rank == 0:\n    torch.save(sd, "model.pt")\n')


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("migration")
    plan = []

    def add(label, source, what=None, **extra):
        workdir = root / re.sub(r"[^\w]+", "_", label)
        workdir.mkdir()
        plan.append(dict(label=label, source=source, workdir=str(workdir), what=what, **extra))
        return str(workdir)

    def where(label):
        return str(root / re.sub(r"[^\w]+", "_", label))

    add("from_ddp/ddp", _source("from_ddp/ddp"), "initial")
    for stage in DDP_STAGES:
        add(f"from_ddp/zeroplus@{stage}", _source("from_ddp/zeroplus", {"stage=3": f"stage={stage}"}), "sharded")
    add("from_ddp/ddp@bf16", _source("from_ddp/ddp", {"USE_BF16 = False": "USE_BF16 = True"}))
    add("from_ddp/zeroplus@bf16", _source("from_ddp/zeroplus", {"USE_BF16 = False": "USE_BF16 = True",
                                                               "stage=3": "stage=2"}))
    # FSDP2 <-> zeroplus: each from scratch, then each resumes from the other's checkpoint.
    add("from_fsdp2/fsdp2", _source("from_fsdp2/fsdp2"), "initial")
    add("from_fsdp2/zeroplus", _source("from_fsdp2/zeroplus"), "sharded")
    add("from_fsdp2/fsdp2@resume", _source("from_fsdp2/fsdp2"), copy_from=where("from_fsdp2/zeroplus"))
    add("from_fsdp2/zeroplus@resume", _source("from_fsdp2/zeroplus"), "sharded", copy_from=where("from_fsdp2/fsdp2"))
    # The DDP script's own save lines (model.module -> model) kept: as DDP at stage 2; at stage 3
    # model.state_dict() raises on rank 0, naming zeroplus.full_state_dict (rank 1 goes on).
    ddp_save = {ZEROPLUS_SAVE: 'if rank == 0:\n    torch.save(model.state_dict(), "model.pt")\n'}
    add("from_ddp/zeroplus@2 ddp-save", _source("from_ddp/zeroplus", {**ddp_save, "stage=3": "stage=2"}))
    add("from_ddp/zeroplus@3 ddp-save", _source("from_ddp/zeroplus", ddp_save),
        raises=((0,), r"zeroplus\.full_state_dict\(model\)"))
    # torch's DCP get_state_dict kept on the zeroplus model: raises on every rank, naming ours.
    add("from_fsdp2/zeroplus torch-dcp", _source("from_fsdp2/zeroplus", {
        "from zeroplus.checkpoint import get_state_dict, set_state_dict":
        "from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict"}),
        raises=((0, 1), r"zeroplus\.checkpoint\.get_state_dict"))
    # DeepSpeed keeps its groups in module globals from its first initialize (a second one in the
    # same process meets the destroyed group), so each DeepSpeed stage gets a launch of its own,
    # as every DeepSpeed script does.
    launches = [plan]
    for stage in DS_STAGES:  # the page's config says stage 2; the test replaces the number only
        plan = []
        launches.append(plan)
        zero = {'"zero_optimization": {"stage": 2}': f'"zero_optimization": {{"stage": {stage}}}'}
        add(f"from_deepspeed/deepspeed@{stage}", _source("from_deepspeed/deepspeed", zero))
        add(f"from_deepspeed/zeroplus@{stage}", _source("from_deepspeed/zeroplus", zero),
            "sharded" if stage == 3 else None)
        add(f"from_deepspeed/load@{stage}", _source("from_deepspeed/zeroplus"), "ds_load",
            dirs={"deepspeed": where(f"from_deepspeed/deepspeed@{stage}"),
                  "zeroplus": where(f"from_deepspeed/zeroplus@{stage}")})
    ranks = [{}, {}]
    for plan in launches:
        for mine, theirs in zip(ranks, run_distributed(_ranks, 2, plan, backend=None, timeout=300)):
            mine.update(theirs)
    return {"ranks": ranks, "dirs": {e["label"]: e["workdir"] for plan in launches for e in plan}}


# -- the checks --------------------------------------------------------------------------------

EXPECTED_BLOCKS = {("run", f"{page}/{side}") for page, sides in (("from_ddp", ("ddp", "zeroplus")),
                                                                  ("from_fsdp2", ("fsdp2", "zeroplus")),
                                                                  ("from_deepspeed", ("deepspeed", "zeroplus")))
                   for side in sides}
# The stage-3 parameters of the pages' TinyLM above the default persistence threshold (100,000
# elements): sharded at the default, as a user runs the script (biases stay whole).
BIG = ["blocks.0.down.weight", "blocks.0.up.weight", "blocks.1.down.weight", "blocks.1.up.weight", "embed.weight",
       "head.weight"]


def _apply(diff: str, source: str) -> str:
    """Applies a page's diff block to `source`: each run of '-' lines, found in order after the
    previous hunk, is replaced by the '+' lines that follow it."""
    hunks, current = [], None
    for line in diff.splitlines():
        if line.startswith("-"):
            if current is None or current[1]:
                current = ([], [])
                hunks.append(current)
            current[0].append(line[1:])
        elif line.startswith("+"):
            assert current is not None, f"a '+' line before any '-' line: {line!r}"
            current[1].append(line[1:])
        else:
            current = None  # context or a blank line ends a hunk
    lines, at = source.splitlines(), 0
    for old, new in hunks:
        for i in range(at, len(lines) - len(old) + 1):
            if lines[i:i + len(old)] == old:
                lines[i:i + len(old)] = new
                at = i + len(new)
                break
        else:
            raise AssertionError(f"the diff's lines {old} are not in the script (after line {at})")
    return "\n".join(lines) + "\n"


def test_pages_have_their_blocks():
    assert EXPECTED_BLOCKS <= set(BLOCKS), sorted(EXPECTED_BLOCKS - set(BLOCKS))
    assert {name for kind, name in BLOCKS if kind == "diff"} == {
        "from_ddp/ddp from_ddp/zeroplus", "from_fsdp2/fsdp2 from_fsdp2/zeroplus",
        "from_deepspeed/deepspeed from_deepspeed/zeroplus"}


@pytest.mark.parametrize("pair", sorted(name for kind, name in BLOCKS if kind == "diff"))
def test_diff_block_is_the_difference(pair):
    before, after = pair.split()
    assert _apply(BLOCKS[("diff", pair)], BLOCKS[("run", before)]) == BLOCKS[("run", after)]


def _saved(runs, label):
    return torch.load(os.path.join(runs["dirs"][label], "model.pt"), weights_only=True)


def _assert_close(got: dict, want: dict, initial: dict, what: str, *, atol: float = 1e-5, rel: float = 0.0):
    """Every tensor of `got` within atol + rel * (how far the reference moved it) of `want`, and the
    reference moved (its largest change more than 10 * atol)."""
    assert sorted(got) == sorted(want), what
    beyond = []
    for name, w in want.items():
        g, w = got[name].float(), w.float()
        assert g.shape == w.shape, (what, name, g.shape, w.shape)
        moved = (w - initial[name].float()).abs().max().item() if name in initial else 0.0
        diff = (g - w).abs().max().item()
        if diff > atol + rel * moved:
            beyond.append(f"{name}: {diff:.3g} (the reference moved it {moved:.3g})")
    moved = max((want[n].float() - v.float()).abs().max().item() for n, v in initial.items() if n in want)
    assert moved > 10 * atol, f"{what}: the reference moved only {moved:.3g}"
    assert not beyond, f"{what}: beyond {atol:g} + {rel:g} x moved: " + "; ".join(beyond)


@pytest.mark.parametrize("stage", DDP_STAGES)
def test_ddp_script_and_its_zeroplus_version_train_alike(runs, stage):
    initial = runs["ranks"][0]["from_ddp/ddp"]
    _assert_close(_saved(runs, f"from_ddp/zeroplus@{stage}"), _saved(runs, "from_ddp/ddp"), initial,
                  f"from_ddp stage {stage}")
    _assert_same_printed(runs, f"from_ddp/zeroplus@{stage}", "from_ddp/ddp")
    assert all(norm > 1.0 for _, _, norm in _printed(runs, "from_ddp/ddp"))  # so the clip at 1.0 clips
    for r, out in enumerate(runs["ranks"]):  # stage 3 shards the big parameters, on every rank
        assert out[f"from_ddp/zeroplus@{stage}"] == (BIG if stage == 3 else []), (r, out[f"from_ddp/zeroplus@{stage}"])


def _printed(runs, label):
    """Rank 0's printed (step, loss, grad norm or None) per step."""
    lines = re.findall(r"step (\d+): loss ([\d.]+)(?:, grad norm ([\d.]+))?", runs["ranks"][0][f"{label} printed"])
    assert lines, f"{label} printed no step lines"
    return [(int(s), float(loss), float(norm) if norm else None) for s, loss, norm in lines]


def _assert_same_printed(runs, got, want, tol=2e-4):
    """The losses and torch's clip_grad_norm_ results the scripts print (4 digits), step by step: a
    clip that silently clipped nothing would print another norm (Adam hides most of it in the weights)."""
    a, b = _printed(runs, got), _printed(runs, want)
    assert [s for s, _, _ in a] == [s for s, _, _ in b], (a, b)
    for (step, loss_a, norm_a), (_, loss_b, norm_b) in zip(a, b):
        assert abs(loss_a - loss_b) <= tol, (got, step, loss_a, loss_b)
        assert (norm_a is None) == (norm_b is None) and (norm_a is None or abs(norm_a - norm_b) <= tol), (
            got, step, norm_a, norm_b)


def test_ddp_save_line_at_stages_2_and_3(runs):
    """docs/from_ddp.md's table: `if rank == 0: torch.save(model.state_dict(), path)` works at stage
    2 (the same weights) and raises on rank 0 at stage 3, naming zeroplus.full_state_dict."""
    initial = runs["ranks"][0]["from_ddp/ddp"]
    _assert_close(_saved(runs, "from_ddp/zeroplus@2 ddp-save"), _saved(runs, "from_ddp/ddp"), initial,
                  "from_ddp stage 2, the DDP save line")
    assert "zeroplus.full_state_dict(model)" in runs["ranks"][0]["from_ddp/zeroplus@3 ddp-save"]
    assert runs["ranks"][1]["from_ddp/zeroplus@3 ddp-save"] is None  # rank 1 did not call it
    assert not os.path.exists(os.path.join(runs["dirs"]["from_ddp/zeroplus@3 ddp-save"], "model.pt"))


def test_torch_dcp_state_dict_on_zeroplus_names_ours(runs):
    """docs/from_fsdp2.md's table: torch's get_state_dict on the zeroplus model raises on every rank,
    naming zeroplus.checkpoint.get_state_dict; nothing was saved."""
    for out in runs["ranks"]:
        assert "zeroplus.checkpoint.get_state_dict" in out["from_fsdp2/zeroplus torch-dcp"]
    assert not os.path.exists(os.path.join(runs["dirs"]["from_fsdp2/zeroplus torch-dcp"], "checkpoint"))


def test_ddp_script_with_autocast(runs):
    """USE_BF16 = True (torch.autocast bf16 around the forward, parameters fp32) at stage 2."""
    initial = runs["ranks"][0]["from_ddp/ddp"]
    _assert_close(_saved(runs, "from_ddp/zeroplus@bf16"), _saved(runs, "from_ddp/ddp@bf16"), initial,
                  "from_ddp autocast stage 2", rel=0.25)


def _dcp(runs, label):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = runs["dirs"][label]
    out = os.path.join(folder, "checkpoint.pt")
    if not os.path.exists(out):
        dcp_to_torch_save(os.path.join(folder, "checkpoint"), out)
    sd = torch.load(out, weights_only=True)
    tensors = {f"model.{k}": v for k, v in sd["model"].items()}
    for fqn, state in sd["optim"]["state"].items():
        tensors.update({f"optim.{fqn}.{k}": v for k, v in state.items()})
    return tensors, int(sd["step"]), sd["optim"]["param_groups"]


@pytest.mark.parametrize("point", ["first", "resumed"])
def test_fsdp2_script_and_its_zeroplus_version_train_alike(runs, point):
    """first: both from scratch; resumed: each from the other's first checkpoint (so each line
    of the resume block read the other library's layout)."""
    suffix = "" if point == "first" else "@resume"
    want, want_step, want_groups = _dcp(runs, "from_fsdp2/fsdp2" + suffix)
    got, got_step, got_groups = _dcp(runs, "from_fsdp2/zeroplus" + suffix)
    assert got_step == want_step == (4 if point == "first" else 8)
    initial = {f"model.{k}": v for k, v in runs["ranks"][0]["from_fsdp2/fsdp2"].items()}
    _assert_close(got, want, initial, f"from_fsdp2 {point}")
    _assert_same_printed(runs, "from_fsdp2/zeroplus" + suffix, "from_fsdp2/fsdp2" + suffix)
    for key in ("lr", "betas", "weight_decay", "eps"):
        assert [g[key] for g in got_groups] == [g[key] for g in want_groups], key
    for r, out in enumerate(runs["ranks"]):
        assert out["from_fsdp2/zeroplus" + suffix] == BIG, (r, out["from_fsdp2/zeroplus" + suffix])


@pytest.mark.parametrize("stage", DS_STAGES)
def test_deepspeed_loop_and_its_zeroplus_version_train_alike(runs, stage):
    """Both checkpoints, read by zeroplus.load_checkpoint (DeepSpeed's format too): equal weights;
    the printed losses equal step by step."""
    loaded = runs["ranks"][0][f"from_deepspeed/load@{stage}"]
    initial = runs["ranks"][0]["from_ddp/ddp"]  # the same TinyLM and seed on every page
    _assert_close(loaded["zeroplus"], loaded["deepspeed"], initial, f"from_deepspeed stage {stage}")
    _assert_same_printed(runs, f"from_deepspeed/zeroplus@{stage}", f"from_deepspeed/deepspeed@{stage}")
    if stage == 3:
        for r, out in enumerate(runs["ranks"]):
            assert out["from_deepspeed/zeroplus@3"] == BIG, (r, out["from_deepspeed/zeroplus@3"])


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_page_links_resolve(page):
    """Every relative link of the page names an existing file and, with #anchor, one of its headings."""
    text = (REPO / "docs" / f"{page}.md").read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        file = (REPO / "docs" / path) if path else REPO / "docs" / f"{page}.md"
        if not file.exists():
            broken.append(target)
            continue
        headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
        if anchor and anchor not in headings:
            broken.append(target)
    assert not broken, f"docs/{page}.md: links to nothing: {broken}"
