"""keel.backends.gpu."""
