"""The package as a user gets it: the built wheel in a fresh environment, versions, typing, optional triton."""
from __future__ import annotations

import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

import flexc

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _run(args, cwd, env=None, timeout=300):
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


def _readme_snippet() -> str:
    """The first Python block under README's "## Use"."""
    match = re.search(r"^## Use\n.*?```python\n(.*?)```", README, re.S | re.M)
    assert match, "README has no ```python block under '## Use'"
    return match.group(1)


def test_built_wheel_installs_into_a_fresh_venv_and_runs_the_readme_from_elsewhere(tmp_path):
    # Offline and quick: build from a copy of the sources with the setuptools already installed,
    # install the wheel alone (--no-deps --no-index), and let the fresh venv see this
    # environment's torch (the pinned one) through a .pth line. Only plain directories listed in a
    # .pth are added, so this environment's own (editable) flexc is not visible there.
    import importlib.metadata

    setuptools_major = int(importlib.metadata.version("setuptools").split(".")[0])
    assert setuptools_major >= 77, "building the wheel offline needs setuptools>=77 here (make setup installs it)"
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "flexc", src / "flexc", ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp_path / "dist"), str(src)], cwd=tmp_path)
    wheels = list((tmp_path / "dist").glob("flexc-*.whl"))
    assert [w.name for w in wheels] == [f"flexc-{flexc.__version__}-py3-none-any.whl"]

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          str(wheels[0])], cwd=tmp_path)
    site = pathlib.Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             cwd=tmp_path).strip())
    (site / "_host_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["FLEXC_CACHE_DIR"] = str(tmp_path / "cache")
    version_line = f"flexc {flexc.__version__} (torch {torch.__version__})"
    assert _run([str(venv / "bin" / "flexc"), "--version"], cwd=elsewhere, env=env).strip() == version_line
    assert _run([str(python), "-m", "flexc", "--version"], cwd=elsewhere, env=env).strip() == version_line
    # One process: where flexc came from, its metadata, then the README snippet exactly as written.
    probe = ("import flexc, importlib.metadata, pathlib\n"
             "print('FROM', pathlib.Path(flexc.__file__).parent, importlib.metadata.version('flexc'),\n"
             "      pathlib.Path(flexc.__file__).with_name('py.typed').is_file())\n")
    (elsewhere / "snippet.py").write_text(probe + _readme_snippet())
    out = _run([str(python), "snippet.py"], cwd=elsewhere, env=env, timeout=600)
    _, package_dir, version, typed = out.splitlines()[0].split()
    assert pathlib.Path(package_dir).is_relative_to(site), package_dir
    assert version == flexc.__version__ and typed == "True"
    assert "(q_idx >= kv_idx) & (q_idx - kv_idx <= 256)" in out and "BlockMask(shape=(1, 1, 4096, 4096)" in out


def test_readme_tested_versions_are_the_ones_this_suite_runs_with():
    table = dict(re.findall(r"^\| (Python|torch|triton) \| ([0-9.]+) \|", README, re.M))
    assert set(table) == {"Python", "torch", "triton"}, table
    triton = pytest.importorskip("triton")
    assert torch.__version__.split("+")[0] == table["torch"]
    assert triton.__version__ == table["triton"]
    assert "%d.%d" % sys.version_info[:2] == table["Python"]


@pytest.mark.parametrize("package", ["torch", "triton"])
def test_the_oldest_version_allowed_is_the_one_ci_tests(package):
    oldest = re.search(rf"^\| {package}, the oldest allowed \| ([0-9.]+) \|", README, re.M).group(1)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^OLDEST_{package.upper()} := {re.escape(oldest)}$", makefile, re.M)
    floor = ".".join(oldest.split(".")[:2])
    assert f'"{package}>={floor}"' in (ROOT / "pyproject.toml").read_text()
    assert "make test-oldest" in (ROOT / ".ci" / "run").read_text().splitlines()


def _public_callables():
    for name in flexc.__all__:
        obj = getattr(flexc, name)
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr not in ("__init__", "__getitem__"):
                    continue
                member = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if inspect.isfunction(member) and member.__name__ != "<lambda>":  # lambdas: table accessors
                    yield f"{name}.{attr}", member
        elif inspect.isfunction(obj):
            yield name, obj


def test_public_api_has_return_annotations():
    missing = [name for name, fn in _public_callables()
               if inspect.signature(fn).return_annotation is inspect.Signature.empty]
    assert len(list(_public_callables())) > 30
    assert missing == []


def test_everything_but_running_triton_kernels_works_without_triton(tmp_path):
    # `sys.modules["triton"] = None` makes every `import triton` fail, as on a machine without it.
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, flexc\n"
        "def causal(b, h, q_idx, kv_idx):\n"
        "    return q_idx >= kv_idx\n"
        "q, k, v = (torch.randn(1, 2, 96, 16, dtype=torch.float64) for _ in range(3))\n"
        "bm = flexc.create_block_mask(causal, None, None, 96, 96, BLOCK_SIZE=32)\n"
        "out = flexc.flex_attention(q, k, v, block_mask=bm)\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "assert torch.allclose(out, ref), 'CPU path'\n"
        "assert '@triton.jit' in flexc.kernel_source(q, k, v, block_mask=bm, kernel_options={'BACKEND': 'TRITON'})\n"
        "try:\n"
        "    flexc.flex_attention(q, k, v, block_mask=bm, kernel_options={'BACKEND': 'TRITON'})\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLEXC_CACHE_DIR=str(tmp_path))
    out = _run([sys.executable, "-c", script], cwd=tmp_path, env=env)
    assert "pip install 'flexc[triton]'" in out
