"""Reusable Qt widgets that draw plain data (arrays, dataclasses): block map, plots, chat view."""
