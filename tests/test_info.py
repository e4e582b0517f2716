"""python -m jax_ep.info and jax_ep.__version__: what a bug report quotes."""

import subprocess
import sys

import jax

import jax_ep


def test_version_is_the_installed_distributions():
    assert jax_ep.__version__ != "" and jax_ep.__version__[0].isdigit()


def test_info_names_versions_engines_and_devices():
    out = subprocess.run(
        [sys.executable, "-m", "jax_ep.info"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert f"jax_ep {jax_ep.__version__}" in out
    assert f"jax {jax.__version__}" in out
    assert "cpu engine: POSIX shared memory" in out
    assert "cpu devices:" in out
