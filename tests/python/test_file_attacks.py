"""Planted-name attacks on the files zeroplus creates (issue 29, items 1 and 2), end to end.

A hostile local user (uid `nobody`) plants names in world-writable sticky directories before a
job run by root, on a machine where fs.protected_symlinks=0 and fs.protected_regular=0 (as
here and on many containers): symbolic links to a root-owned victim file, or regular files the
attacker owns. Every scenario runs in a private mount namespace with a throwaway tmpfs as
/dev/shm and another as the sticky directory (the pattern of test_backend_small_devshm.py);
the namespace's sysctls are the machine's.

* the /dev/shm host token: `zeroplus-host-token` malformed and `zeroplus-host-token.<pid>`
  linked to the victim for the next 4000 pids; an ordinary 2-rank job (init_process_group +
  allreduce) must succeed, the victim must be untouched and the malformed token left as it was.
  Same with regular files planted under those names: the token zeroplus creates must be root's,
  the planted files untouched.
* AioHandle.atomic_write into the sticky directory: `.ckpt.bin.tmp-<pid>-<n>` linked to the
  victim (or planted as the attacker's regular files) for the writer's pid and the next 4000:
  the write must succeed into a root-owned regular `ckpt.bin` holding the tensor, the victim and
  the planted files untouched; a target name that is a planted link fails naming the path.
Before the fix (a9cedf5) the victim was overwritten with the token / the tensor bytes and the
token and checkpoint became the attacker's files. Needs root and unshare(1); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
NOBODY = 65534
PIDS_AHEAD = 4000

# Runs inside the namespace (root), prints one JSON object.
_CHILD = r'''
import json, os, sys, pathlib
import torch
import torch.distributed as dist
NOBODY, AHEAD = 65534, int(sys.argv[2])
shm, sticky, victim = pathlib.Path("/dev/shm"), pathlib.Path(sys.argv[4]), pathlib.Path(sys.argv[1])

def as_nobody(fn):
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY); os.setuid(NOBODY); fn(); os._exit(0)
        except BaseException as e:
            print("nobody failed:", repr(e), file=sys.stderr); os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0

def next_pids():
    first = int(pathlib.Path("/proc/sys/kernel/ns_last_pid").read_text())
    return [os.getpid()] + list(range(first, first + AHEAD))

def clear(d):
    for p in d.iterdir():
        p.unlink()

def plant(names, kind):
    def go():
        for n in names:
            if kind == "link":
                os.symlink(victim, n)
            else:
                n.write_text("planted")
    as_nobody(go)

def intact(names, kind):
    # every planted name still there, as planted (a link, or the attacker's own text)
    try:
        return all(n.is_symlink() if kind == "link" else n.read_text() == "planted" for n in names)
    except OSError:
        return False

def job():
    from harness import run_distributed, DistributedTestError
    import test_file_attacks as m
    try:
        return run_distributed(m._allreduce, 2, timeout=90, pg_timeout=30) == [2.0, 2.0], ""
    except DistributedTestError as e:
        return False, str(e)[-1500:]

def token_scenario(kind):
    clear(shm)
    names = [shm / f"zeroplus-host-token.{p}" for p in next_pids()]
    if kind == "link":
        as_nobody(lambda: (shm / "zeroplus-host-token").write_text("not a token\n"))
    plant(names, kind)
    ok, err = job()
    token = shm / "zeroplus-host-token"
    st = token.lstat() if token.exists() else None
    return {"job_ok": ok, "job_error": err, "victim": victim.read_bytes().decode("latin-1")[:40],
            "token": token.read_text() if st else None, "token_uid": st.st_uid if st else None,
            "planted_intact": intact(names, kind)}

def atomic_scenario(kind):
    clear(sticky)
    target = sticky / "ckpt.bin"
    names = [sticky / f".ckpt.bin.tmp-{p}-{k}" for p in next_pids() for k in range(2)]
    plant(names, kind)
    import zeroplus.aio as aio
    t = torch.arange(16, dtype=torch.int32)
    out = {}
    try:
        aio.AioHandle().atomic_write(t, str(target))
        out["write"] = "ok"
    except OSError as e:
        out["write"] = f"{type(e).__name__}: {e}"
    st = target.lstat() if os.path.lexists(target) else None
    out.update({"victim": victim.read_bytes().decode("latin-1")[:40], "target_regular": bool(st) and not target.is_symlink(),
                "target_uid": st.st_uid if st else None,
                "target_bytes_ok": bool(st) and target.read_bytes() == t.numpy().tobytes(),
                "planted_intact": intact(names, kind)})
    return out

def link_target_scenario():
    clear(sticky)
    target = sticky / "ckpt.bin"
    as_nobody(lambda: os.symlink(victim, target))
    import zeroplus.aio as aio
    try:
        aio.AioHandle().atomic_write(torch.arange(4, dtype=torch.int32), str(target))
        write = "ok"
    except OSError as e:
        write = f"{type(e).__name__}: {e}"
    return {"write": write, "victim": victim.read_bytes().decode("latin-1")[:40], "still_link": target.is_symlink()}

which = sys.argv[3]
result = {"token": token_scenario, "atomic": atomic_scenario}[which](sys.argv[5]) if which != "target" \
    else link_target_scenario()
print("RESULT " + json.dumps(result))
'''


def _allreduce(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    return float(t[0])


@pytest.fixture(scope="module")
def namespace_root():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    base = pathlib.Path(tempfile.mkdtemp(prefix="zeroplus-attack-"))
    base.chmod(0o711)  # nobody may pass through to the sticky directory, not list or write here
    (base / "shared").mkdir()
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _run(base, which, kind=""):
    victim = base / "victim"
    victim.write_text("precious")
    victim.chmod(0o600)
    sticky = base / "shared"
    inner = ('mount --make-rprivate / && mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && '
             'mount -t tmpfs -o size=96m,mode=1777 tmpfs "$5" && exec "$0" -c "$1" "$2" "$3" "$4" "$5" "$6"')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO / "plugin" / "python"), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", inner, sys.executable, _CHILD, str(victim), str(PIDS_AHEAD), which, str(sticky),
         kind],
        cwd=HERE, capture_output=True, text=True, timeout=240, env=env,
    )
    out = proc.stdout + proc.stderr
    if "RESULT " not in proc.stdout and "mount" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace: {proc.stderr.strip()[:200]}")
    assert "RESULT " in proc.stdout, out[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    print(f"{which} {kind}: {result} ({time.monotonic() - start:.1f} s)")
    return result


def test_host_token_planted_symlinks_are_not_followed(namespace_root):
    r = _run(namespace_root, "token", "link")
    assert r["job_ok"], r["job_error"]
    assert r["victim"] == "precious", r
    assert r["token"] == "not a token\n" and r["token_uid"] == NOBODY, r  # left alone, not rewritten
    assert r["planted_intact"], r


def test_host_token_planted_regular_files_are_not_taken_over(namespace_root):
    r = _run(namespace_root, "token", "file")
    assert r["job_ok"], r["job_error"]
    assert r["token_uid"] == 0 and len(r["token"]) == 32, r  # zeroplus's own file, not the attacker's
    assert r["planted_intact"] and r["victim"] == "precious", r


def test_atomic_write_planted_symlinks_are_not_followed(namespace_root):
    r = _run(namespace_root, "atomic", "link")
    assert r["write"] == "ok", r
    assert r["victim"] == "precious", r
    assert r["target_regular"] and r["target_uid"] == 0 and r["target_bytes_ok"], r
    assert r["planted_intact"], r


def test_atomic_write_planted_regular_files_are_not_taken_over(namespace_root):
    r = _run(namespace_root, "atomic", "file")
    assert r["write"] == "ok", r
    assert r["target_regular"] and r["target_uid"] == 0 and r["target_bytes_ok"], r
    assert r["planted_intact"] and r["victim"] == "precious", r


def test_atomic_write_onto_a_planted_link_fails_naming_the_path(namespace_root):
    r = _run(namespace_root, "target")
    assert r["write"].startswith("OSError") or "Error" in r["write"], r
    assert "ckpt.bin" in r["write"] and "symbolic link" in r["write"], r
    assert r["victim"] == "precious" and r["still_link"], r
