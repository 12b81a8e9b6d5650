"""A first install and ``--help`` (case U08): the configs ship inside the package, so an installed
ddp_exp runs from any folder; building it prints no setuptools warning; ``--help`` shows the
user's config groups, the top-level keys and an example, not the internal ``schema/*`` groups."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_help_shows_the_users_groups_keys_and_an_example(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ddp_exp", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "schema" not in text
    lines = set(text.splitlines())
    for group in sorted(p for p in (ROOT / "conf").iterdir() if p.is_dir()):
        if group.name in ("hydra", "__pycache__"):
            continue
        options = sorted(f.stem for f in group.glob("*.yaml"))
        assert f"{group.name}: {', '.join(options)}" in lines, (group.name, text)
    # The top-level keys with a value of their own (not a section, not a group's choice): the
    # schema's root holds their defaults, conf/config.yaml only what differs.
    import dataclasses

    from ddp_exp.config.schema import Config

    config = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())
    root = Config()
    top = [f.name for f in dataclasses.fields(Config)
           if getattr(root, f.name) != "???" and not dataclasses.is_dataclass(getattr(root, f.name))
           and not isinstance(getattr(root, f.name), dict)]
    assert top, config
    for key in top:
        assert any(line.startswith(f"{key}: ") for line in lines), (key, text)
    assert "python -m ddp_exp backend=gloo world_size=2" in text


def test_every_config_group_is_a_listed_package():
    """Each folder of conf/ is a package in pyproject.toml (setuptools warns about a data
    folder it is not told of, once per folder, at every install)."""
    listed = re.findall(r'"(ddp_exp\.conf[\w.]*)"', (ROOT / "pyproject.toml").read_text())
    groups = {f"ddp_exp.conf.{p.relative_to(ROOT / 'conf').as_posix().replace('/', '.')}"
              for p in (ROOT / "conf").rglob("*") if p.is_dir() and p.name != "__pycache__"}
    assert groups, "conf/ has no groups"
    assert groups <= set(listed), sorted(groups - set(listed))


@pytest.mark.slow
def test_wheel_builds_without_warnings_and_holds_every_config(tmp_path):
    """`pip install .` builds a wheel with conf/ as ddp_exp/conf, every YAML of the source tree
    in it (Hydra's pkg://ddp_exp.conf finds them without the checkout), and the build log holds
    no warning (it held ~20 lines of them per build: the license table, nine config groups)."""
    src = tmp_path / "src_tree"  # a copy: the build writes build/ and *.egg-info next to it
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("src", "conf"):
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    # This machine's pip configuration and PYTHONDONTWRITEBYTECODE add warnings of their own.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PIP_CONFIG_FILE"] = os.devnull
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-v", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    log = (out.stdout + out.stderr).replace(str(tmp_path), "<tmp>")  # its name says "warn"
    assert [ln for ln in log.splitlines() if re.search("warn", ln, re.I)] == []
    (wheel,) = (tmp_path / "dist").glob("ddp_exp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"ddp_exp/conf/{p.relative_to(ROOT / 'conf').as_posix()}"
                for p in (ROOT / "conf").rglob("*.yaml")}
    assert expected and expected <= names, sorted(expected - names)
    assert "ddp_exp/__main__.py" in names
    modules = {f"ddp_exp/{p.relative_to(ROOT / 'src' / 'ddp_exp').as_posix()}"
               for p in (ROOT / "src" / "ddp_exp").rglob("*.py")}  # subpackages: ddp_exp.data
    assert "ddp_exp/data/__init__.py" in modules and modules <= names, sorted(modules - names)


def test_the_makefiles_editable_install_prints_no_warning(tmp_path):
    """U08: the Makefile's editable installs (``pip install -e``) run with EDITABLE_QUIET, and
    its first one, as make runs it, prints no warning (here without dependencies and into a
    folder of its own, ``--target``: the suite's other processes import ddp_exp from the
    environment meanwhile)."""
    makefile = (ROOT / "Makefile").read_text()
    installs = [ln for ln in makefile.splitlines() if "pip install" in ln and " -e " in ln]
    assert len(installs) == 3 and all("$(EDITABLE_QUIET) $(BIN)/python -m pip" in ln
                                      for ln in installs), installs  # run, dev, bench
    plan = subprocess.run(["make", "-C", str(ROOT), "--dry-run", "--always-make",
                           ".venv/.installed-run"], capture_output=True, text=True, timeout=60)
    line = next(ln for ln in plan.stdout.splitlines() if "pip install" in ln and " -e ." in ln)
    out = subprocess.run(f"{line} --no-deps --target {tmp_path / 'target'}", shell=True,
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    noise = [ln for ln in (out.stdout + out.stderr).splitlines()
             if ln.strip() and "Location 'file:" not in ln]  # this machine's pip configuration
    assert noise == [], noise
