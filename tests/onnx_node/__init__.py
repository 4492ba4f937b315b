"""onnx node-suite conformance of keel.onnx_backend."""
