"""Which proof makes classic fixed-batch files batch-dynamic: ONNX shape inference, ONNX
Runtime's symbolic shape inference, dim-0 tracking, layout — alone and together.

    python benchmarks/batch_provers.py            # the corpus's zoo entries (exports on first run)

Per model and prover set: does ``lint_batch`` pass at batches 1, 3 and 8 after
``rewrite_batch``, how many constants stay unproven, and the seconds the rewrite took (ratios
between prover sets on the same model, same run; the host's ISA flags are printed).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import corpus  # noqa: E402
from enginekit import lint_batch, target  # noqa: E402
from enginekit.errors import ModelError  # noqa: E402
from enginekit.passes import rewrite_batch  # noqa: E402

SETS = {
    "onnx": ("onnx",),
    "ort-symbolic": ("ort-symbolic",),
    "onnx+ort": ("onnx", "ort-symbolic"),
    "all": ("onnx", "ort-symbolic", "batch-axis", "layout"),
}


def main() -> int:
    print(f"# host ISA: {' '.join(f for f in target.host()['isa'] if f.startswith('avx'))}")
    print(f"{'model':34s} " + " ".join(f"{k:>22s}" for k in SETS))
    for entry in corpus.select(["zoo"]):
        # The original fixed-batch file, as the cache holds it (not made dynamic here).
        original = corpus.prepare(dataclasses.replace(entry, fixed_batch=False)).onnx
        cells = []
        for provers in SETS.values():
            start = time.perf_counter()
            result = rewrite_batch(str(original), provers=provers)
            seconds = time.perf_counter() - start
            try:
                ok = lint_batch(result.model, sizes=(1, 3, 8)) == []
            except ModelError:
                ok = False
            cells.append(f"{'pass' if ok else 'FAIL'} u{len(result.unproven)} {seconds:6.2f}s")
        print(f"{entry.name:34s} " + " ".join(f"{c:>22s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
