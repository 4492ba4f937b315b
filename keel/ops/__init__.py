"""The op set: what each op means, independent of any backend."""

from keel.ops.registry import Op, OpGroup, op_group, to_op
from keel.ops.schema import OpSchema, get_schema
from keel.ops.types import TensorType

__all__ = ["Op", "OpGroup", "OpSchema", "TensorType", "get_schema", "op_group", "to_op"]
