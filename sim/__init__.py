"""Instruments that measure a training step without knowing what ZeRO is."""
