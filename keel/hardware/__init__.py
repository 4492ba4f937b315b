"""keel.hardware."""
