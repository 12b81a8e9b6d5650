"""The configs ship inside the package: an installed ddp_exp runs from any folder."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_holds_every_config(tmp_path):
    """`pip install .` builds a wheel with conf/ as ddp_exp/conf: every YAML of the source tree
    is in it, so Hydra's pkg://ddp_exp.conf finds them without the checkout."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("ddp_exp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"ddp_exp/conf/{p.relative_to(ROOT / 'conf').as_posix()}"
                for p in (ROOT / "conf").rglob("*.yaml")}
    assert expected and expected <= names, sorted(expected - names)
    assert "ddp_exp/__main__.py" in names
