"""The environment the install script builds: CPU torch, vLLM's hybrid model importable."""

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
    # A fresh interpreter: the torchvision start-up hook must work in every new process.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_cpu_torch_and_qwen3_5_model_module_import():
    result = _run(
        "import torch, torchvision; assert torch.version.cuda is None, torch.__version__;"
        "import vllm.model_executor.models.qwen3_5 as m; print(m.__name__)"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "qwen3_5" in result.stdout


def test_no_cuda_only_audio_packages():
    result = _run("import importlib.util as u; print(u.find_spec('torchaudio'), u.find_spec('torchcodec'))")
    assert result.stdout.strip() == "None None", result.stdout
