"""Figures: each function takes analysis results and returns a matplotlib Figure."""
