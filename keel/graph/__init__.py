"""keel.graph."""
