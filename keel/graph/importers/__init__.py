"""keel.graph.importers."""
