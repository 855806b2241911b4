#!/usr/bin/env bash
# Install the peer routers (sglang-router, vllm-router) in a venv of their own, for
# loadtests/compare_peers.py. Idempotent: re-running only installs what is missing.
#   loadtests/setup_peers.sh [VENV_DIR]      (default ~/.cache/warmroute/peers-venv)
# PEERS_PYTHON=python3.12 picks the interpreter for a fresh venv.
set -euo pipefail
VENV="${1:-${WARMROUTE_PEERS_VENV:-$HOME/.cache/warmroute/peers-venv}}"
PY="${PEERS_PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating venv $VENV ($("$PY" --version 2>&1))"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
rc=0
have() { "$VENV/bin/python" -m pip show "$1" >/dev/null 2>&1; }
for pkg in sglang-router vllm-router; do
  if have "$pkg"; then
    echo "$pkg: present ($("$VENV/bin/python" -m pip show "$pkg" | sed -n 's/^Version: //p'))"
  elif "$VENV/bin/python" -m pip install --quiet "$pkg"; then
    echo "$pkg: installed ($("$VENV/bin/python" -m pip show "$pkg" | sed -n 's/^Version: //p'))"
  else
    echo "$pkg: INSTALL FAILED" >&2
    rc=1
  fi
done
# what compare_peers.py runs
"$VENV/bin/python" -c "import sglang_router" 2>/dev/null && echo "sglang_router importable" || echo "sglang_router NOT importable" >&2
[ -x "$VENV/bin/vllm-router" ] && echo "vllm-router binary: $VENV/bin/vllm-router" || echo "vllm-router binary missing" >&2
exit $rc
