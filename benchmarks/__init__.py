"""Measurements of the runtime, and those that need both sides (transformers and the runtime):
not part of the installed package; the runtime imports nothing from here."""
