"""Helpers for tests and benchmarks: model builders (``keel.testing.models``)."""
