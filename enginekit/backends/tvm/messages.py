"""TVM's error texts made into one line for enginekit's error messages (a leaf module: the
layout, lowering, import and runtime modules all use it)."""

from __future__ import annotations

import re
from typing import Any

from enginekit.errors import BuildError

#: The footer TVM's printer ends a module or expression with (in error texts).
_PRINTER_FOOTER = re.compile(r"^#?\s*Metadata omitted\.")


def error_line(exc: BaseException) -> str:
    """The last informative line of a TVM exception's text, for a one-line error message.

    TVM error texts often end with a printed IR expression, whose last line is the printer's
    footer ``# Metadata omitted. Use show_meta=True in script() method to show it.`` instead
    of the failure: that footer (and blank lines) is skipped.
    """
    lines = [ln.strip() for ln in str(exc).splitlines()]
    kept = [ln for ln in lines if ln and not _PRINTER_FOOTER.match(ln)]
    return kept[-1] if kept else ""


def not_constant(op: str, attr: Any, what: str, why: str) -> BuildError:
    """The error for an operand TVM compiles in (``what`` of ``op``; ``why``: what it becomes)
    but that a node feeds at run time; ``attr`` is the converter's attributes (node name)."""
    name = attr["tvm_custom"]["name"] or "<unnamed>"
    return BuildError(
        f"TVM cannot take the {what} of op {op!r} at node {name!r} from a runtime value: it "
        f"compiles {why} in. Make it a constant (an initializer), or build with another "
        "backend (e.g. --backend onnxruntime)."
    )
