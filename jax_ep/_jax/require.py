"""How each module of jax_ep._jax takes what it uses of JAX's private modules: checked where it
is imported, so that a jax that moved or renamed one fails `import jax_ep` with an ImportError
naming the jax version and what is missing, rather than with wrong results later."""

from __future__ import annotations

import importlib

import jax

# The jax versions every module of jax_ep._jax was checked on (each module's docstring says so):
# CI's two ends (Python 3.11 and 3.12) and the GPU machine's.
CHECKED_ON = "0.10.2, 0.11.2 and 0.12.1"


def require(user: str, module: str, *names: str):
    """Module `module` (e.g. "jax._src.dispatch"), holding each of `names` (dotted paths inside
    it, e.g. "RuntimeTokenSet.get_token_input"), for jax_ep's module `user`; an ImportError
    naming the jax version and everything missing otherwise."""
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        missing = [f"{module} ({e})"]
    else:
        missing = [f"{module}.{name}" for name in names if not _holds(found, name)]
    if missing:
        raise ImportError(
            f"{user}: jax {jax.__version__} lacks {', '.join(missing)}, which jax_ep uses "
            f"(checked on jax {CHECKED_ON})"
        )
    return found


def _holds(owner, path: str) -> bool:
    for name in path.split("."):
        if not hasattr(owner, name):
            return False
        owner = getattr(owner, name)
    return True
