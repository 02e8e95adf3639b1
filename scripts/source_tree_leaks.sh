#!/usr/bin/env bash
# Does a build of examples/cpp reach into the zeroplus source or build tree? Used by
# scripts/package_check.sh, whose examples must build from the installed prefix only.
#
#   scripts/source_tree_leaks.sh flags <repo_root> <build_dir> <allowed_dir>... < build.ninja
#   cd <examples_build> && ninja -t deps | scripts/source_tree_leaks.sh deps <repo_root> <build_dir> <allowed_dir>...
#
# Prints each offending line (allowed directories shown as <allowed>) and exits 1 when there is
# one, 0 when there is none, 2 on misuse.
#   flags: include options of the compile lines. CMake passes an imported target's include
#          directories as `-isystem <dir>` (a target of the same project as `-I<dir>`), so both
#          spellings, with or without a space, and -iquote/-idirafter are matched.
#   deps:  the headers the compiler actually opened (ninja's depfile log): catches a leak that
#          no include option shows, e.g. through a symlink or an absolute #include. Relative
#          paths are taken from the current directory, which must be the ninja build directory:
#          with CCACHE_BASEDIR set, ccache hands the compiler relative include paths, so the
#          depfiles name headers relative to it.
# A leak is the repository root itself (the source tree's include root: headers are included
# as "process_group/adapter/backend.hpp"), its source folders, or anything in the build
# directory. Not a leak: <repo_root>/.venv (torch's headers in a developer checkout) and each
# allowed directory (the prefix, the examples' own build directory), which may themselves lie
# inside the build directory (ZEROPLUS_PACKAGE_DIR=build/package).
set -euo pipefail

usage() {
  echo "usage: scripts/source_tree_leaks.sh flags|deps <repo_root> <build_dir> <allowed_dir>... < text" >&2
  exit 2
}
(($# >= 4)) || usage
mode="$1"
# Absolute, without resolving symlinks: CMake writes the paths it was given.
repo_root="$(realpath -ms -- "$2")"
build_dir="$(realpath -ms -- "$3")"
allowed=()
for dir in "${@:4}"; do allowed+=("$(realpath -ms -- "$dir")"); done

# The paths as extended regular expressions ('.' and '+' are common in directory names).
ere() { printf '%s' "$1" | sed 's/[].[\\*^$+?(){}|]/\\&/g'; }
src_folders="(aio|optimizers|process_group|registration|plugin)"
# [^[:space:]\"]: a path inside the quotes CMake adds around one containing spaces.
root_re="$(ere "$repo_root")"  # separate assignments: set -e stops on a failing sed
build_re="$(ere "$build_dir")"
tree="($root_re(/$src_folders(/[^[:space:]\"]*)?)?/?|$build_re(/[^[:space:]\"]*)?)"
case "$mode" in
  flags) pattern="(^|[[:space:]\"])-(I|isystem|iquote|idirafter)[[:space:]]*\"?$tree(\"|[[:space:]]|\$)" ;;
  deps) pattern="^$tree\$" ;;
  *) usage ;;
esac

# Allowed directories are masked first (bash's literal replacement, no regex), so that one
# inside the build directory is not a leak; then one grep over the whole text.
mask() {
  local line dir
  while IFS= read -r line; do
    for dir in "${allowed[@]}"; do line="${line//"$dir"/<allowed>}"; done
    printf '%s\n' "$line"
  done
}
# ninja -t deps: "target: #deps N, ..." lines, then one indented header path per line.
header_paths() {
  local line
  while IFS= read -r line; do
    [[ "$line" =~ ^[[:space:]]+([^[:space:]].*)$ ]] && printf '%s\n' "${BASH_REMATCH[1]}"
  done | xargs -r -d '\n' realpath -ms --
}
input() { if [[ "$mode" == deps ]]; then header_paths; else cat; fi; }
set +e
input | mask | grep -E -- "$pattern"
rc=${PIPESTATUS[2]}
set -e
case "$rc" in
  0) exit 1 ;;  # grep printed the leaks
  1) exit 0 ;;
  *) echo "scripts/source_tree_leaks.sh: grep failed (status $rc) on pattern $pattern" >&2; exit 2 ;;
esac
