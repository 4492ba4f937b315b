"""keel.formats."""
