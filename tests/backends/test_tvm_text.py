"""enginekit's TVM converter for TfIdfVectorizer over integer tokens
(enginekit/backends/tvm/text.py); TVM 0.27's Relax importer has none ("cannot convert op")."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import matches_reference
from onnx import TensorProto, helper

pytest.importorskip("tvm", reason="the tvm backend needs apache-tvm")


def test_tfidf_vectorizer_counts_and_weights_ngrams_with_skips(tmp_path):
    # Unigrams and bigrams with skips up to 2, each mode: TF counts, IDF weights what is
    # present, TFIDF weights the counts.
    pool = dict(
        min_gram_length=1, max_gram_length=2, max_skip_count=2,
        ngram_counts=[0, 3], ngram_indexes=[0, 1, 2, 3, 4, 5],
        pool_int64s=[2, 3, 5, 2, 3, 5, 4, 3, 3],
    )  # fmt: skip
    weights = [0.5, 1.0, 2.0, 1.5, 0.25, 3.0]
    nodes = [
        helper.make_node("TfIdfVectorizer", ["x"], ["tf"], mode="TF", **pool),
        helper.make_node("TfIdfVectorizer", ["x"], ["idf"], mode="IDF", weights=weights, **pool),
        helper.make_node(
            "TfIdfVectorizer", ["x"], ["tfidf"], mode="TFIDF", weights=weights, **pool
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.INT32, [2, 7])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("tf", "idf", "tfidf")],
    )
    path = tmp_path / "tfidf.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)]), path)
    x = np.array([[2, 3, 5, 3, 2, 4, 3], [3, 3, 3, 5, 2, 9, 3]], np.int32)
    matches_reference(path, {"x": x}, "tvm", rtol=1e-6, atol=1e-6)
