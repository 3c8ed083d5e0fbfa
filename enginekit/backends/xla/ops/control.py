"""Control flow: If, when its condition is known when the model is built.

Exporters emit If for checks that depend only on shapes or constants (a rank test, a
``seq > max_len`` guard); XLA compiles one program for static shapes, so the branch is chosen
at trace time and only its nodes are lowered. A condition computed from the inputs' values is
refused with the node named.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from enginekit.backends.xla.ops.common import OpError, is_static


def If(
    cond: Any,
    then_branch: Any = None,
    else_branch: Any = None,
    run: Callable[[Any], Sequence[Any]] | None = None,
) -> Any:
    """``run`` (given by the lowering) lowers a branch's nodes where the If stands."""
    if not is_static(cond):
        raise OpError(
            "If's condition is computed from the inputs' values at run time; the XLA backend "
            "lowers If only when the condition is known when the model is built"
        )
    if run is None:
        raise OpError("If needs the lowering's branch runner")
    taken = then_branch if bool(cond.reshape(-1)[0]) else else_branch
    return tuple(run(taken))
