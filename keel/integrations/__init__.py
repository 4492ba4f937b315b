"""Engines keel plugs into (``keel.integrations.ray``); each imports its engine only when used."""
