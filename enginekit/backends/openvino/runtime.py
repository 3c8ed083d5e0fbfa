"""The OpenVINO Engine: one infer request per calling thread over one compiled model, and
``infer_async`` on OpenVINO's own queue of asynchronous requests."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import numpy as np

from enginekit.engine import Batch, Engine, TensorSpec
from enginekit.errors import EnginekitError


class OvEngine(Engine):
    """An Engine over an ``openvino.CompiledModel``.

    Attributes:
        compiled: the CompiledModel.
        compiled_from: ``"blob"`` (the artifact's exported compiled model) or ``"ir"`` (the IR,
            compiled on load).
    """

    def __init__(self, compiled: Any, manifest: dict[str, Any], compiled_from: str) -> None:
        from enginekit.config import BuildConfig

        config = BuildConfig.from_json(manifest["config"])
        super().__init__(
            [TensorSpec.from_json(s) for s in manifest["inputs"]],
            [TensorSpec.from_json(s) for s in manifest["outputs"]],
            config.profiles,
            manifest,
        )
        self.compiled = compiled
        self.compiled_from = compiled_from
        ports = {n: i for i, p in enumerate(compiled.inputs) for n in p.get_names()}
        missing = [s.name for s in self.inputs if s.name not in ports]
        if missing:
            raise EnginekitError(
                f"the compiled OpenVINO model has no input(s) {', '.join(missing)}; rebuild it"
            )
        self._ports = tuple(ports[s.name] for s in self.inputs)
        self._out_names = tuple(o.name for o in self.outputs)
        self._out_dtypes = tuple(np.dtype(o.dtype) for o in self.outputs)
        self._local = threading.local()
        self._queue: Any = None
        self._queue_lock = threading.Lock()

    def _request(self) -> Any:
        # InferRequests are not thread-safe; the compiled model is: one request per thread.
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        return request

    def _tensors(self, feeds: dict[str, np.ndarray]) -> dict[int, np.ndarray]:
        return {port: feeds[s.name] for port, s in zip(self._ports, self.inputs)}

    def _outputs(self, request: Any) -> dict[str, np.ndarray]:
        out = {}
        for i, (name, dtype) in enumerate(zip(self._out_names, self._out_dtypes)):
            data = request.get_output_tensor(i).data
            out[name] = np.array(data, dtype=dtype, copy=True)
        return out

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        request = self._request()
        request.infer(self._tensors(feeds), share_inputs=True)
        return self._outputs(request)

    def infer_async(self, batch: Batch) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        """Run a batch on OpenVINO's asynchronous request queue; returns a Future of the result.

        Validated like :meth:`infer`. A batch that must be split or is empty runs through the
        base class's worker thread instead. Blocks while every request of the queue is busy.
        """
        if self._closed:
            raise EnginekitError("infer_async() on a closed engine; load it again")
        feeds = self._feeds(batch)
        rows = self._check(feeds)
        if rows is not None:
            return super().infer_async(batch)
        future: concurrent.futures.Future[dict[str, np.ndarray]] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        # The queue copies the inputs into its request's tensors (share_inputs=False): the
        # caller may reuse its arrays as soon as this returns.
        with self._queue_lock:
            queue = self._async_queue()
            queue.start_async(self._tensors(feeds), future, share_inputs=False)
        return future

    def _async_queue(self) -> Any:
        if self._queue is None:
            import openvino as ov

            self._queue = ov.AsyncInferQueue(self.compiled)
            self._queue.set_callback(self._done)
        return self._queue

    def _done(self, request: Any, future: concurrent.futures.Future[Any]) -> None:
        try:
            future.set_result(self._outputs(request))
        except BaseException as exc:  # a failure must reach the caller, not OpenVINO's thread
            future.set_exception(exc)

    def _close(self) -> None:
        if self._queue is not None:
            self._queue.wait_all()
            self._queue = None
        self._local = threading.local()
        self.compiled = None
