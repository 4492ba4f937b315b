"""keel's benchmark suite: keel and onnxruntime side by side on the same models."""
