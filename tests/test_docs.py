"""The docs stay true: docs/API.md names every public argument, attribute and result field, the
README's Python runs as written, the docs point only at files that exist, bench/results/ holds the
files they cite and no others, and every number of a benchmark table is in the result file that
the table names."""

import ast
import glob
import inspect
import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh

import jax_ep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "CHANGELOG.md", "lab/README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md")
)
RESULTS = "bench/results"


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
        "memory_plan()": parameters(jax_ep.memory_plan),
    }
    names.update({f"{name}()": [name, *parameters(fn)] for name, fn in methods.items()})
    missing = {
        what: gaps
        for what, found in names.items()
        if (gaps := [n for n in found if n not in documented])
    }
    assert not missing, f"not in docs/API.md: {missing}"


# The "Planning memory" table's columns: the plan's keys summed, and memory_plan's modes.
MEMORY_COLUMNS = {
    "window, float32 rows (default)": (("window",), {}),
    "window, bfloat16 rows": (("window",), dict(max_row_dtype=jnp.bfloat16)),
    "expert buffer, float32 x": (("expert_buffer",), {}),
    "expert buffer, bfloat16 x": (("expert_buffer",), dict(max_row_dtype=jnp.bfloat16)),
    "expert buffer, FP8 with scales": (("expert_buffer", "scales"), dict(fp8=True)),
    "expert buffer, FP8 with scales, `capacity_factor=1.25`": (
        ("expert_buffer", "scales"),
        dict(fp8=True, capacity_factor=1.25),
    ),
}


def test_the_memory_table_is_memory_plans():
    """docs/API.md's V3 table, in GiB to the digits shown, recomputed by jax_ep.memory_plan."""
    section = read("docs/API.md").split("## Planning memory")[1].split("\n## ")[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    table = [line for line in lines if line.startswith("| EP layout |")]
    assert len(table) == 1, "the Planning memory section has one table of EP layouts"
    start = lines.index(table[0])
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    assert header[:3] == ["EP layout", "`axis_sizes`", "experts"]
    assert header[3:] == list(MEMORY_COLUMNS), header
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[start + 2 :]]
    assert len(rows) == 4
    for label, sizes, experts, *cells in rows:
        for column, cell in zip(MEMORY_COLUMNS.values(), cells, strict=True):
            keys, modes = column
            plan = jax_ep.memory_plan(
                ast.literal_eval(sizes.strip("`")),
                num_experts=int(experts),
                hidden=7168,
                num_topk=8,
                max_tokens_per_rank=4096,
                **modes,
            )
            want = sum(plan[k] for k in keys) / 2**30
            assert cell == f"{want:.{len(cell.partition('.')[2])}f}", (label, column, cell)


def test_the_check_sees_a_missing_name():
    names = code_names("`buf.dispatch(x)`, a handle\n```python\nd = f(capacity=1)\n```\n`y`")
    assert {"dispatch", "capacity", "y"} <= names and "handle" not in names


def test_readme_python_runs():
    """Every ```python block of the README, in order, in one namespace (each continues the one
    before, as the README says), on the test run's devices."""
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


TABLE_SOURCE = re.compile(r"<!-- results: (.+?) -->")


def cited_paths(doc):
    """The repository paths doc points at, relative to the repository's root (a link from docs/
    may be relative to docs/), and the result files its tables name."""
    here, text = os.path.dirname(doc), read(doc)
    paths = [p for names in TABLE_SOURCE.findall(text) for p in names.split()]
    for t in linked_paths(text):
        near = os.path.normpath(os.path.join(here, t))
        paths.append(near if os.path.exists(os.path.join(ROOT, near)) else os.path.normpath(t))
    return paths


@pytest.mark.parametrize("doc", DOCS)
def test_docs_point_at_files_that_exist(doc):
    paths = cited_paths(doc)
    globs = [p for p in paths if set(p) & set("*?[]{}")]
    assert not globs, f"{doc} points at files by pattern, not by name: {globs}"
    missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"{doc} points at missing files: {missing}"


def test_the_path_check_sees_a_missing_file():
    assert linked_paths("see `SPEC.md` and [this](docs/NOPE.md), `H/128`, `bench/ep.py`") == [
        "docs/NOPE.md",
        "SPEC.md",
        "bench/ep.py",
    ]


def result_files():
    """Every file under bench/results/ but its index, relative to the repository's root."""
    return {
        os.path.relpath(os.path.join(d, name), ROOT)
        for d, _, names in os.walk(os.path.join(ROOT, RESULTS))
        for name in names
        if name != "README.md" or d != os.path.join(ROOT, RESULTS)
    }


def test_results_are_the_files_the_docs_cite_and_the_index_names():
    cited = {p for doc in DOCS for p in cited_paths(doc) if p.startswith(RESULTS + "/")}
    index = read(f"{RESULTS}/README.md")
    indexed = {f"{RESULTS}/{p}" for p in re.findall(r"^\| `([^`]+)` \|", index, re.M)}
    kept = result_files()
    assert kept - cited == set(), "results no doc cites (git history keeps them: git rm them)"
    assert kept == indexed, f"{RESULTS}/README.md lists {indexed ^ kept} wrongly"


def test_docs_keep_their_length():
    assert len(read("README.md").splitlines()) <= 150
    assert len(read("docs/PERFORMANCE.md").splitlines()) <= 300


# A word of the work's log, not of the product (in two pieces, so that this file has none).
LOG_WORD = re.compile("ses" + "sion", re.I)


@pytest.mark.parametrize("doc", DOCS + [f"{RESULTS}/README.md"])
def test_docs_speak_of_runs_days_and_machines(doc):
    assert not LOG_WORD.search(read(doc)), f"{doc}: say the run, the day or the machine instead"


# A benchmark table names its result file on the line right before it, and every number in its
# cells but the first column (the row's label) is a value of that file, rounded to the decimals
# the table shows (a percentage also as a fraction).
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(%?)")


def tables(text):
    """Each markdown table of text, as (the files its `<!-- results: ... -->` line names, or None;
    its body rows as lists of cells)."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        end = i
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        source = TABLE_SOURCE.fullmatch(lines[i - 1].strip()) if i else None
        body = lines[i + 2 : end]
        rows = [[c.strip() for c in row.strip().strip("|").split("|")] for row in body]
        found.append((source.group(1).split() if source else None, rows))
        i = end
    return found


def values(path):
    """Every number in a result file: a JSON record's numeric values, or a text's numbers."""
    text = read(path)
    if not path.endswith(".json"):
        return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", text)]
    found, stack = [], [json.loads(text)]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int | float) and not isinstance(item, bool):
            found.append(float(item))
    return found


def numbers_not_in(rows, known):
    """The numbers of rows (first column left out) that no value of known rounds to."""
    known = np.asarray(known, np.float64)
    missing = []
    for row in rows:
        for cell in row[1:]:
            for number, percent in NUMBER.findall(cell):
                tolerance = 0.5 * 10.0 ** -len(number.partition(".")[2]) + 1e-9
                scaled = known * 100 if percent else known
                if not np.any(np.abs(scaled - float(number)) <= tolerance):
                    missing.append(number + percent)
    return missing


@pytest.mark.parametrize("doc", DOCS)
def test_benchmark_tables_read_their_result_files(doc):
    for sources, rows in tables(read(doc)):
        if sources is None:
            assert doc != "README.md", f"a README table names no result file: {rows[:1]}"
            continue
        if doc == "README.md":
            assert len(sources) == 1, f"a README table cites one result file, not {sources}"
        assert all(s.startswith(RESULTS + "/") for s in sources), sources
        missing = numbers_not_in(rows, [v for s in sources for v in values(s)])
        assert not missing, f"{doc}: {missing} are not in {sources} (rows {rows})"


def test_the_table_check_sees_a_wrong_number_and_a_missing_source():
    record = f"{RESULTS}/ops/v3-nvidia-h100-2026-12-05-prefetch.json"
    table = "| op | us | GB/s |\n|---|---:|---:|\n| dispatch | 127.3 | 238 |\n"
    text = f"<!-- results: {record} -->\n{table}"
    ((sources, rows),) = tables(text)
    assert sources == [record] and numbers_not_in(rows, values(record)) == []
    wrong = rows[0][:1] + ["127.4", "238 (97%)"]
    assert numbers_not_in([wrong], values(record)) == ["127.4", "97%"]
    assert tables(table)[0][0] is None


def readme_commands(text):
    """The commands of the README's "Two commands" block, without their comments."""
    block = re.search(r"## Two commands\n+```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_commands_as_written():
    ci = read(".ci/run")
    ran = dict(re.findall(r'^(DEMO_COMMAND|TEST_COMMAND)="(.*)"$', ci, re.M))
    assert readme_commands(read("README.md")) == [ran["DEMO_COMMAND"], ran["TEST_COMMAND"]]
    assert ci.count('"$DEMO_COMMAND"') == 1 and ci.count('"$TEST_COMMAND"') == 2


def test_the_command_check_sees_another_command():
    text = "## Two commands\n\n```bash\npip install x  # a comment\npytest\n```\n"
    assert readme_commands(text) == ["pip install x", "pytest"]
