"""scripts/source_tree_leaks.sh, the check that package_check.sh's C++ examples build from the
installed prefix only, on fabricated build.ninja and `ninja -t deps` text. Imported targets'
include directories reach build.ninja as `-isystem <dir>`: the check it replaced grepped for
`-I<repo>` and so could never see the leak a wrong zeroplusConfig.cmake would cause."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "source_tree_leaks.sh"


@pytest.fixture
def tree(tmp_path):
    # '+' and '.' in the name: the paths must be matched literally, not as regex.
    repo = tmp_path / "owner+repo.x"
    (repo / "build-package" / "examples").mkdir(parents=True)
    return repo


def _check(mode, text, repo, build=None, allowed=None, cwd=None):
    build = build or repo / "build"
    allowed = allowed or [repo / "build-package" / "prefix", repo / "build-package" / "examples"]
    r = subprocess.run(["bash", str(SCRIPT), mode, str(repo), str(build), *map(str, allowed)], input=text,
                       capture_output=True, text=True, timeout=30, cwd=cwd)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode == 1, r.stdout


def test_installed_prefix_and_venv_are_clean(tree):
    torch_include = tree / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "include"
    line = (f"  INCLUDES = -isystem {tree}/build-package/prefix/include/zeroplus -isystem {torch_include} "
            f"-isystem {torch_include}/torch/csrc/api/include\n")
    assert _check("flags", line, tree) == (False, "")


@pytest.mark.parametrize("option", [
    "-isystem {repo}",  # what a zeroplusConfig.cmake exporting the build interface would give
    "-isystem{repo}",
    "-I{repo}",
    "-I {repo}/",
    "-I{repo}/process_group/core",
    "-isystem {repo}/optimizers",
    "-iquote {repo}/aio",
    '-isystem "{repo}"',
    "-I{repo}/build",
    "-isystem {repo}/build/generated/include",
])
def test_source_or_build_tree_include_is_a_leak(tree, option):
    line = f"  INCLUDES = {option.format(repo=tree)} -isystem {tree}/build-package/prefix/include/zeroplus\n"
    leaked, out = _check("flags", line, tree)
    assert leaked and out.startswith(f"  INCLUDES = {option.format(repo=tree)} -isystem <allowed>/"), out


@pytest.mark.parametrize("option", [
    "-isystem {parent}/ownerrrepo_x",  # what "owner+repo.x" would match as a regex
    "-isystem {repo}/examples",  # not a source folder of the library
    "-isystem {repo}/build-package/prefix/include",
    "-DZEROPLUS_ROOT={repo}",
])
def test_near_misses_are_not_leaks(tree, option):
    line = f"  INCLUDES = {option.format(repo=tree, parent=tree.parent)}\n"
    assert _check("flags", line, tree) == (False, "")


def test_prefix_inside_the_build_directory(tree):
    build = tree / "build"
    line = f"  INCLUDES = -isystem {build}/package/prefix/include/zeroplus\n"
    assert _check("flags", line, tree, build, [build / "package" / "prefix"]) == (False, "")
    leaked, _ = _check("flags", line + f"  INCLUDES = -isystem {build}/lib\n", tree, build, [build / "package" / "prefix"])
    assert leaked


def test_deps_resolves_relative_header_paths(tree):
    # With CCACHE_BASEDIR the compiler sees relative include paths, so the depfiles do too.
    examples = tree / "build-package" / "examples"
    clean = (f"CMakeFiles/cpp_allreduce.dir/allreduce.cpp.o: #deps 3, deps mtime 1 (VALID)\n"
             f"    {tree}/examples/cpp/allreduce.cpp\n"
             f"    ../prefix/include/zeroplus/process_group/adapter/backend.hpp\n"
             f"    /usr/include/c++/12/vector\n\n")
    assert _check("deps", clean, tree, cwd=examples) == (False, "")
    leaked, out = _check("deps", clean + "    ../../process_group/adapter/backend.hpp\n", tree, cwd=examples)
    assert leaked and out.split() == [f"{tree}/process_group/adapter/backend.hpp"], out
