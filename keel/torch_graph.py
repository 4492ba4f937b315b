"""An ONNX graph run by torch, node by node: the speed reference on a GPU.

keel's GPU target is torch on the same GPU. To time torch on exactly the
model keel runs (same graph, same weights), this runs an ONNX graph with
torch's own functional ops, one call per node, as an eager ``nn.Module`` of
the same architecture would: ``Conv`` is ``F.conv2d`` (cuDNN),
``BatchNormalization`` is ``F.batch_norm`` in inference mode, ``Gemm`` is
``F.linear`` (cuBLAS), and so on. It covers the ops of the models in
``benchmarks/zoo.py``; another op raises ``NotImplementedError`` naming it.

``benchmarks/gpu.py`` also times torch's CUDA-graph replay and its float16
autocast of the same calls; ``keel bench --vs torch`` uses it too. torch is
needed only here (``pip install 'keel-runtime[zoo]'``), imported when a graph
is made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["TorchGraph"]


class TorchGraph:
    """An ONNX graph as torch calls on ``device``; call it with torch tensors by input name."""

    def __init__(self, model: bytes | onnx.ModelProto, device: str = "cuda") -> None:
        import torch

        proto = model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)
        self.torch = torch
        self.device = device
        self.inputs = [i.name for i in proto.graph.input
                       if i.name not in {t.name for t in proto.graph.initializer}]
        self.outputs = [o.name for o in proto.graph.output]
        self.host: dict[str, np.ndarray] = {}
        self.weights: dict[str, Any] = {}
        for init in proto.graph.initializer:
            array = numpy_helper.to_array(init)
            self.host[init.name] = array
            self.weights[init.name] = torch.from_numpy(np.array(array)).to(device)
        self.nodes: list[tuple[Callable[..., Any], list[str], list[str]]] = []
        for node in proto.graph.node:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            self.nodes.append((self._op(node.op_type, attrs, list(node.input)),
                               list(node.input), list(node.output)))

    def __call__(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        env = dict(self.weights)
        env.update(feeds)
        for fn, ins, outs in self.nodes:
            result = fn(*[env[i] if i else None for i in ins])
            if len(outs) == 1:
                env[outs[0]] = result
            else:
                env.update(zip(outs, result, strict=False))
        return {name: env[name] for name in self.outputs}

    # ---- ops -------------------------------------------------------------
    def _op(self, op: str, attrs: dict[str, Any], ins: list[str]) -> Callable[..., Any]:
        import torch
        import torch.nn.functional as F

        if op == "Conv":
            return self._conv(attrs)
        if op == "BatchNormalization":
            eps = float(attrs.get("epsilon", 1e-5))
            return lambda x, s, b, m, v: F.batch_norm(x, m, v, s, b, False, 0.0, eps)
        if op == "Gemm":
            return self._gemm(attrs)
        if op == "MaxPool":
            k = list(attrs["kernel_shape"])
            pads = list(attrs.get("pads", [0] * 2 * len(k)))
            strides = list(attrs.get("strides", [1] * len(k)))
            return lambda x: F.max_pool2d(x, k, strides, pads[:len(k)])
        simple: dict[str, Callable[..., Any]] = {
            "Relu": torch.relu, "Identity": lambda x: x, "Add": torch.add, "Mul": torch.mul,
            "Div": torch.div, "Sub": torch.sub, "Erf": torch.erf, "MatMul": torch.matmul,
            "Sigmoid": torch.sigmoid, "Tanh": torch.tanh,
            "GlobalAveragePool": lambda x: x.mean(dim=(2, 3), keepdim=True),
        }
        if op in simple:
            return simple[op]
        if op == "Clip":
            lo = self.host[ins[1]].item() if len(ins) > 1 and ins[1] else None
            hi = self.host[ins[2]].item() if len(ins) > 2 and ins[2] else None
            return lambda x, *_: torch.clamp(x, lo, hi)
        if op == "Flatten":
            axis = int(attrs.get("axis", 1))
            return lambda x: x.reshape(int(np.prod(x.shape[:axis])), -1)
        if op == "Reshape":
            shape = [int(d) for d in self.host[ins[1]]]
            return lambda x, _: x.reshape([x.shape[i] if d == 0 else d
                                           for i, d in enumerate(shape)])
        if op == "Transpose":
            perm = list(attrs["perm"])
            return lambda x: x.permute(perm)
        if op == "Softmax":
            axis = int(attrs.get("axis", -1))
            return lambda x: torch.softmax(x, axis)
        if op == "LayerNormalization":
            axis, eps = int(attrs.get("axis", -1)), float(attrs.get("epsilon", 1e-5))
            return lambda x, w, b=None: F.layer_norm(x, x.shape[axis:], w, b, eps)
        if op == "Gather":
            if int(attrs.get("axis", 0)) != 0:
                raise NotImplementedError("Gather on an axis other than 0")
            return lambda data, idx: F.embedding(idx, data)
        raise NotImplementedError(f"torch reference has no {op}")

    @staticmethod
    def _conv(attrs: dict[str, Any]) -> Callable[..., Any]:
        import torch.nn.functional as F

        k = list(attrs["kernel_shape"])
        pads = list(attrs.get("pads", [0] * 2 * len(k)))
        if pads[:len(k)] != pads[len(k):]:
            raise NotImplementedError("asymmetric conv padding")
        strides = list(attrs.get("strides", [1] * len(k)))
        dilations = list(attrs.get("dilations", [1] * len(k)))
        group = int(attrs.get("group", 1))
        return lambda x, w, b=None: F.conv2d(x, w, b, strides, pads[:len(k)], dilations, group)

    @staticmethod
    def _gemm(attrs: dict[str, Any]) -> Callable[..., Any]:
        import torch.nn.functional as F

        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 \
                or attrs.get("beta", 1.0) != 1.0:
            raise NotImplementedError("Gemm with transA, alpha or beta")
        if attrs.get("transB", 0):
            return lambda a, b, c=None: F.linear(a, b, c)
        return lambda a, b, c=None: F.linear(a, b.t(), c)
