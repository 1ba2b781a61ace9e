"""Tooling: commands that use the runtime; the runtime never imports them."""
