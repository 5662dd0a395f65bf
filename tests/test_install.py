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


def _lock(device: str) -> dict[str, str]:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "deploy" / f"requirements-{device}.lock").read_text()
    pins = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            requirement, _, digest = line.partition(" --hash=sha256:")
            name, _, version = requirement.partition("==")
            assert len(digest) == 64, line
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_locks_satisfy_pyproject_and_the_environment_matches_the_cpu_lock():
    """Every dependency pyproject.toml names is in each lock at a version it allows, and this
    environment (built by install.sh from the CPU lock) has exactly the locked versions."""
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for device in ("cpu", "gpu"):
        pins = _lock(device)
        for spec in project["dependencies"] + extras[device] + extras["test"]:
            requirement = Requirement(spec)
            name = requirement.name.lower().replace("_", "-")
            assert name in pins, (device, name)
            assert requirement.specifier.contains(pins[name].split("+")[0], prereleases=True), (
                device,
                spec,
                pins[name],
            )
    for name, pinned in _lock("cpu").items():
        if name in ("torchaudio", "torchcodec"):  # removed after install (CUDA builds)
            continue
        assert version(name) == pinned, name
