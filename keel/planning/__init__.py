"""keel.planning."""
