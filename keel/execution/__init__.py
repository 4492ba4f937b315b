"""keel.execution."""
