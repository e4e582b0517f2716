"""The examples run and do what they say."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_moe_loss_falls():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example picks 8 devices
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_moe.py"),
                          "--steps", "30"], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < 0.5 * first, out.stdout
