"""The examples and the demo run and do what they say."""

import os
import re
import subprocess
import sys

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# They pick their own devices (8 CPU devices without an accelerator).
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def run_python(*args, timeout=900):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=ENV
    )


def test_train_moe_loss_falls():
    out = run_python(os.path.join(ROOT, "examples", "train_moe.py"), "--steps", "30")
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < 0.5 * first, out.stdout


def test_demo_agrees_with_the_reference_on_the_devices_present():
    """8 CPU devices without an accelerator (the test run's too), else the GPUs."""
    out = run_python("-m", "jax_ep.demo")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    devices = jax.devices()
    assert f"{len(devices)} x {devices[0].device_kind}," in out.stdout, out.stdout
    assert "dispatch + combine bitwise equal" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("OK"), out.stdout


def test_importing_the_demo_leaves_xla_flags_alone():
    out = run_python("-c", "import os, jax_ep.demo; print(os.environ.get('XLA_FLAGS'))")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "None"
