"""jit mode (filled in by its own module's author)."""
