"""keel.backends.reference."""
