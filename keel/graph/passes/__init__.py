"""keel.graph.passes."""
