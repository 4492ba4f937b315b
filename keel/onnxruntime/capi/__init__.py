"""Mirrors ``onnxruntime.capi``: its exception module."""

from keel.onnxruntime.capi import onnxruntime_pybind11_state

__all__ = ["onnxruntime_pybind11_state"]
