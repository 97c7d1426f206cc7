#!/usr/bin/env bash
# The two quick-start commands:
#   ./run.sh train [ARGS]   set up .venv, then run `prefixgym train` (the main job)
#   ./run.sh test  [ARGS]   set up .venv, then run the test suite
#   ./run.sh demo  [ARGS]   set up .venv, then run `prefixgym demo`
# Setup installs torch's CPU wheel first when no torch is present, so that the
# package's plain `torch` requirement never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
venv=${PREFIXGYM_VENV:-.venv}
py=$venv/bin/python

setup() {
  [[ -x $py ]] || python3 -m venv "$venv"
  if ! "$py" -c 'import torch' 2>/dev/null; then
    "$py" -m pip install -q --disable-pip-version-check 'torch==2.13.0'
  fi
  # Reinstall only when the project's requirements changed.
  local stamp=$venv/.prefixgym-setup
  local want
  want=$(cat pyproject.toml run.sh | sha256sum | cut -d' ' -f1)
  if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    "$py" -m pip install -q --disable-pip-version-check -e '.[dev]'
    # The tests run tinker-cookbook's recipes on the local engine (tests/tinker/);
    # --no-deps: 0.6.1 pins a tml-renderers that is not on PyPI (its other
    # requirements come with the `cookbook` extra).
    "$py" -m pip install -q --disable-pip-version-check --no-deps 'tinker-cookbook==0.6.1'
    echo "$want" > "$stamp"
  fi
}

# Spin-waiting OpenMP threads slow torch badly on a shared, busy CPU.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

cmd=${1:-}
shift || true
case $cmd in
  train) setup; exec "$venv/bin/prefixgym" train "$@" ;;
  demo)  setup; exec "$venv/bin/prefixgym" demo "$@" ;;
  # two pytest-xdist workers, one per core of the CI machine (tests/conftest.py gives
  # each one torch thread); tests go out in collection order, in ever smaller batches, to
  # whichever worker runs low. A later -n wins: -n 0 runs in one process (for --pdb, -s).
  test)  setup; exec "$py" -m pytest -n 2 --dist load "$@" ;;
  *) echo "usage: ./run.sh train|test|demo [ARGS]" >&2; exit 2 ;;
esac
