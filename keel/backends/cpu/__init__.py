"""keel.backends.cpu."""
