"""The built wheel carries every package module, preset and kernel module, and works outside the
checkout and from its root (where the source tree shadows the install)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)]
    subprocess.run(cmd, check=True, cwd=out)
    (path,) = out.glob("jaxmamba-*.whl")
    return path


def test_wheel_holds_every_module_preset_and_kernel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    # jaxmamba/kernels and jaxmamba/configs are links into kernels/ and configs/ in some
    # checkouts (git worktrees): those come from their own folders below.
    modules = [
        p
        for p in (ROOT / "jaxmamba").rglob("*.py")
        if p.relative_to(ROOT / "jaxmamba").parts[0] not in ("kernels", "configs")
    ]
    presets = [
        p for p in (ROOT / "configs").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    ]
    kernels = [p for p in (ROOT / "kernels").rglob("*.py")]
    expected = {p.relative_to(ROOT).as_posix() for p in modules}
    expected |= {"jaxmamba/configs/" + p.relative_to(ROOT / "configs").as_posix() for p in presets}
    expected |= {"jaxmamba/kernels/" + p.relative_to(ROOT / "kernels").as_posix() for p in kernels}
    assert any(n.endswith(".safetensors") for n in expected)
    assert sorted(expected - names) == []


def test_installed_wheel_loads_every_preset_from_another_folder(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
    )
    script = """
import jaxmamba, jaxmamba.kernels
from jaxmamba.config import checkpoint_dir, list_presets
from jaxmamba.model.families import load_config
from jaxmamba.tokenizer import load_tokenizer
print(jaxmamba.__file__)
print(jaxmamba.kernels.__file__)
for name in list_presets():
    cfg = load_config(name)
    ckpt = checkpoint_dir(name)
    tok = load_tokenizer(name, cfg)
    print(name, cfg.num_layers, ckpt is not None, tok is not None)
"""
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(str(site)) and lines[1].startswith(str(site)), lines[:2]
    loaded = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert {"nemotron-h-tiny", "nemotron-nano-9b-v2", "mamba2-130m", "mamba2-2.7b"} <= set(loaded)
    assert loaded["nemotron-h-demo"][1:] == ["True", "True"]


def readme_snippet() -> str:
    """The README's "Use it" example, as a new user would copy it."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use it") :]
    return section[section.index("```python\n") + len("```python\n") :].split("```", 1)[0]


def test_readme_snippet_runs_from_the_checkout_root_after_a_plain_install(wheel, tmp_path):
    # A venv holding the wheel (as `pip install .` leaves it) and, through a .pth naming this
    # venv's site-packages, its dependencies; a .pth line runs none of that folder's own .pth
    # files, so this checkout's editable install (a .pth import hook) stays out.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel]
    subprocess.run(cmd, check=True)
    # `python -c` from the checkout root puts the root first on sys.path, as running a file
    # saved there does: the source tree's jaxmamba/ shadows the installed one.
    script = readme_snippet() + (
        "\nimport jaxmamba, jaxmamba.kernels, jaxmamba.configs"
        "\nprint(jaxmamba.__file__, jaxmamba.kernels.__file__, jaxmamba.configs.__file__)"
    )
    run = subprocess.run([python, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    package, kernels, configs = run.stdout.splitlines()[-1].split()
    assert package == str(ROOT / "jaxmamba" / "__init__.py")
    assert kernels == str(ROOT / "kernels" / "__init__.py")
    assert configs == str(ROOT / "configs" / "__init__.py")
