"""One module per op family; importing this package registers every schema."""

from keel.ops.schemas import (  # noqa: F401
    attention,
    control,
    conv,
    elementwise,
    indexing,
    loss,
    matmul,
    memory,
    ml,
    normalization,
    numeric,
    pooling,
    quantization,
    recurrent,
    reduction,
    resize,
    shape,
    signal,
    trees,
    vision,
)
