"""Triton Python-backend model: the file copied as `<repository>/<replica>/1/model.py`.

It runs inside Triton's Python stub, reads its `tangram` parameter (backend kind, model source,
limits) from config.pbtxt, and loads the backend with the real loading code in
`reward_servers.backends`. Requests carry one JSON document per batch row (TYPE_STRING
"REQUEST"), results go back the same way ("RESULT"). All requests the dynamic batcher hands over
in one `execute` call are scored in a single backend call, i.e. one forward pass.

The host tier (issue 38): each instance answers `offload`/`restore`/`state` on its own control
socket (`reward_servers.control`), moving its backend's weights between the device and their
host copy while the process, its imports and the model object stay. A batch that reaches an
offloaded instance (not one the manager leased: Triton's own retry, say) restores it first.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        params = json.loads(config["parameters"]["tangram"]["string_value"])
        if params["src"] not in sys.path:
            sys.path.insert(0, params["src"])
        from reward_servers.backends import BackendParams, load_backend

        gpu = args.get("model_instance_kind") == "GPU"
        device = f"cuda:{args['model_instance_device_id']}" if gpu else "cpu"
        self.backend = load_backend(
            params["kind"],
            BackendParams(
                kind=params["kind"],
                path=params.get("path"),
                package=params.get("package"),
                rule=params.get("rule"),
                device=device,
                max_seq_len=int(params.get("max_seq_len", 512)),
                cpu_threads=int(params.get("cpu_threads", 1)),
            ),
        )
        self.lock = threading.Lock()  # a batch and a weight move never overlap
        self.weights = getattr(self.backend, "weights", None)
        self.control = None
        if params.get("control_dir") and self.weights is not None:
            from reward_servers.control import ControlServer, socket_path

            path = socket_path(Path(params["control_dir"]), args["model_name"], args["model_instance_name"])
            self.control = ControlServer(path, self._control)

    def _control(self, cmd: str) -> dict[str, Any]:
        assert self.weights is not None
        with self.lock:
            seconds = 0.0
            if cmd == "offload":
                seconds = self.weights.offload()
            elif cmd == "restore":
                seconds = self.weights.restore()
            return {"on_device": self.weights.on_device, "seconds": seconds, "nbytes": self.weights.nbytes}

    def finalize(self) -> None:
        if self.control is not None:
            self.control.close()

    def execute(self, requests: list[Any]) -> list[Any]:
        with self.lock:
            if self.weights is not None and not self.weights.on_device:
                self.weights.restore()
            return self._execute(requests)

    def _execute(self, requests: list[Any]) -> list[Any]:
        rows: list[dict[str, Any]] = []
        counts: list[int] = []
        try:
            for request in requests:
                arr = pb_utils.get_input_tensor_by_name(request, "REQUEST").as_numpy()
                items = [json.loads(x) for x in arr.reshape(-1)]
                rows.extend(items)
                counts.append(len(items))
            results = self.backend.score(rows)
        except Exception as e:  # one bad batch must not take the model down
            error = pb_utils.TritonError(f"{type(e).__name__}: {e}")
            return [pb_utils.InferenceResponse(output_tensors=[], error=error) for _ in requests]
        responses, at = [], 0
        for n in counts:
            out = np.array([[json.dumps(r).encode()] for r in results[at : at + n]], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("RESULT", out)]))
            at += n
        return responses
