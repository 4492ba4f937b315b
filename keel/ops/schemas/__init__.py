"""One module per op family; importing this package registers every schema."""

from keel.ops.schemas import (  # noqa: F401
    conv,
    elementwise,
    indexing,
    matmul,
    memory,
    normalization,
    pooling,
    quantization,
    reduction,
    resize,
    shape,
)
