"""The docs stay true: docs/API.md names every public argument, attribute and result field, the
README's Python runs as written, and the docs point only at files that exist."""

import glob
import inspect
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh

import jax_ep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


FENCED = re.compile(r"```\w*\n(.*?)```", re.S)


def code_names(text):
    """The code of a markdown text (fenced blocks and `...` spans), and the identifiers in it."""
    spans = FENCED.findall(text) + re.findall(r"`([^`]+)`", FENCED.sub("", text))
    return set(spans) | {name for span in spans for name in re.findall(r"\w+", span)}


def public_methods(cls):
    return {
        name: member
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def parameters(fn):
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def test_api_names_every_argument_attribute_and_field():
    documented = code_names(read("docs/API.md"))
    buf = jax_ep.Buffer(
        make_mesh(4), "ep", num_experts=8, hidden=128, num_topk=2, max_tokens_per_rank=4
    )
    attributes = [name for name in vars(buf) if not name.startswith("_")]
    methods = public_methods(jax_ep.Buffer) | {"run_between": jax_ep.Pending.run_between}
    names = {
        "Buffer": parameters(jax_ep.Buffer.__init__),
        "Buffer attributes": attributes,
        "DispatchResult fields": list(jax_ep.DispatchResult._fields),
        "jax_ep": list(jax_ep.__all__),
    }
    names.update({f"{name}()": [name, *parameters(fn)] for name, fn in methods.items()})
    missing = {
        what: gaps
        for what, found in names.items()
        if (gaps := [n for n in found if n not in documented])
    }
    assert not missing, f"not in docs/API.md: {missing}"


def test_the_check_sees_a_missing_name():
    names = code_names("`buf.dispatch(x)`, a handle\n```python\nd = f(capacity=1)\n```\n`y`")
    assert {"dispatch", "capacity", "y"} <= names and "handle" not in names


def test_readme_python_runs():
    """Every ```python block of the README, in order, in one namespace (each continues the one
    before, as the README says), on the test session's devices."""
    blocks = re.findall(r"```python\n(.*?)```", read("README.md"), re.S)
    assert len(blocks) >= 3
    scope = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), scope)
    # What the README says of its results.
    x, y, y2 = (np.asarray(scope[n], np.float32) for n in ("x", "y", "y2"))
    assert y.shape == x.shape and np.abs(y).max() > 0
    np.testing.assert_allclose(y2, y + np.tanh(x), rtol=0.05, atol=0.05)
    assert scope["rows"].dtype == jnp.float8_e4m3fn
    assert scope["out"].shape == x.shape and np.isfinite(float(scope["aux"].loss))


def linked_paths(text):
    """Repository paths a markdown text points at: link targets, and code spans that start with a
    top-level entry of the repository or name a markdown file."""
    tops = {entry for entry in os.listdir(ROOT) if not entry.startswith(".git")}
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
    for span in re.findall(r"`([^`\s]+)`", FENCED.sub("", text)):
        if ("/" in span and span.split("/")[0] in tops) or span.endswith(".md"):
            targets.append(span)
    return targets


@pytest.mark.parametrize("doc", DOCS)
def test_docs_point_at_files_that_exist(doc):
    here = os.path.dirname(os.path.join(ROOT, doc))
    missing = [
        t
        for t in linked_paths(read(doc))
        if not (glob.glob(os.path.join(ROOT, t)) or glob.glob(os.path.join(here, t)))
    ]
    assert not missing, f"{doc} points at missing files: {missing}"


def test_the_path_check_sees_a_missing_file():
    assert linked_paths("see `SPEC.md` and [this](docs/NOPE.md), `H/128`, `bench/ep.py`") == [
        "docs/NOPE.md",
        "SPEC.md",
        "bench/ep.py",
    ]
