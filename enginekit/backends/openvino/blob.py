"""The OpenVINO build's fresh process: ONNX -> IR -> compiled model -> exported blob.

OpenVINO names the nodes its frontend and transformations create from process-wide counters,
so a model read and compiled twice in one process writes two different IRs and blobs. In a
fresh process the same model and options give the same bytes: builds stay reproducible.

    python -m enginekit.backends.openvino.blob SOURCE.onnx WORKDIR CONFIG_JSON

Prints the compiled model's facts as one JSON line; a BuildError is printed as
``BuildError: message`` on stderr with exit code 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from enginekit.backends import openvino as backend
    from enginekit.config import BuildConfig
    from enginekit.errors import BuildError

    source, workdir, config = argv
    try:
        facts = backend.compile_to(
            Path(source), BuildConfig.from_json(json.loads(config)), Path(workdir)
        )
    except BuildError as exc:
        print(f"BuildError: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
