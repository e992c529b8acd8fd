# Sourced by the .ci/install-*.sh scripts: creates a framework's test venv, optionally layered on a base
# venv so that the large packages every venv needs (torch and triton, 1.4 GB) are installed once.
#
#   make_venv VENV [BASE_VENV]
#
# With BASE_VENV the new venv gets a .pth file naming BASE_VENV's site-packages: its own packages come
# first on sys.path and BASE_VENV's after them, and pip counts BASE_VENV's packages as installed, so a
# pinned version it already holds is not installed again while a different one is installed in VENV.
# Both venvs must run the same Python (site-packages are per version).

make_venv() {
    local venv=$1 base=${2:-}
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
    [[ -n $base ]] || return 0
    if [[ ! -x $base/bin/python ]]; then
        echo "base venv $base has no bin/python: build it first (tests/run.sh builds .venv)" >&2
        return 1
    fi
    local version='import sys; print(sys.version_info[:2])' purelib='import sysconfig; print(sysconfig.get_path("purelib"))'
    if [[ $("$venv/bin/python" -c "$version") != $("$base/bin/python" -c "$version") ]]; then
        echo "$venv and base venv $base run different Pythons; layer only venvs of one Python" >&2
        return 1
    fi
    "$base/bin/python" -c "$purelib" >"$("$venv/bin/python" -c "$purelib")/_mori_sglang_base_venv.pth"
}
