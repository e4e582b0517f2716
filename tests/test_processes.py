"""jax_ep across processes on CPU devices (tests/processes.py): a mesh spanning 2 or 4
processes of 1 to 4 devices, against the reference path; Buffers that differ between processes;
a process that stops early; more than 32 ranks in one process."""

import jax
import pytest
from processes import launch


def assert_ok(results):
    for p, (code, out) in enumerate(results):
        if code != 0 or "SCENARIO OK" not in out:
            every = "\n".join(
                f"---- process {q} (exit {c}):\n{o[-6000:]}" for q, (c, o) in enumerate(results)
            )
            raise AssertionError(f"process {p} failed (exit {code})\n{every}")


JAX_0_12 = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 12)
SHUTDOWN_BARRIER = pytest.mark.xfail(
    JAX_0_12,
    reason="on jax 0.12.1, 1 of 2 whole-suite runs: after check_invalid's raise, process 0 "
    "missed jax.distributed's shutdown barrier and JAX aborted all four; cause not found yet",
    strict=False,
)


@pytest.mark.parametrize(
    "num_processes,devices,dp",
    [(2, 2, 1), pytest.param(4, 1, 1, marks=SHUTDOWN_BARRIER), (2, 4, 2)],
    ids=["2x2", "4x1", "2x4-dp2"],
)
def test_mesh_across_processes_matches_reference(num_processes, devices, dp):
    assert_ok(launch("flat", num_processes, devices, env={"DP": str(dp)}))


@pytest.mark.parametrize(
    "num_nodes,devices", [(2, 2), (4, 2), (2, 4), (2, 1)], ids=["2x2", "4x2", "2x4", "2x1"]
)
def test_processes_as_nodes_match_reference(num_nodes, devices):
    """A Buffer over ("node", "ep"), one process per node; 2 x 2 then loses a node: an error
    on the others, not a hang; 2 x 1 also raises on invalid ids (check_invalid)."""
    missing = {"MISSING_NODE": "1"} if (num_nodes, devices) == (2, 2) else {}
    checking = {"CHECK_INVALID": "1"} if devices == 1 else {}
    results = launch("nodes", num_nodes, devices, env=missing | checking)
    if missing:
        code, out = results[0]
        assert code == 0 and "SCENARIO OK" in out and "RAISED:" in out, out[-4000:]
        code, out = results[1]  # the node that stops, after its own checks
        assert code == 0 and "CHECKS OK" in out, out[-4000:]
    else:
        assert_ok(results)


@pytest.mark.xfail(
    JAX_0_12,
    reason="on jax 0.12.1 every process stays inside the mismatched op's program (XLA's execute) "
    "until the test's timeout; it passes on jax 0.10.2; cause not found yet",
    run=False,
)
def test_nodes_that_run_different_ops_are_an_error():
    results = launch("nodes_running_different_ops", 2, 2, timeout=300)
    assert_ok(results)
    for _, out in results:
        assert "RAISED:" in out


def test_buffers_that_differ_between_processes_raise_everywhere():
    results = launch("mismatched_arguments", 2, 1, timeout=300)
    assert_ok(results)
    for _, out in results:
        assert "RAISED:" in out


def test_a_process_that_stops_early_is_an_error_on_its_peers():
    results = launch("early_exit", 2, 1, timeout=300)
    code, out = results[0]
    assert code == 0 and "SCENARIO OK" in out and "RAISED:" in out, out[-4000:]


def test_more_ranks_than_a_mask_holds():
    assert_ok(launch("many_ranks", 1, 40, timeout=300))
