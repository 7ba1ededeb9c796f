"""Policies against a trace without training: intervals, the engine, reports, the anchor."""
