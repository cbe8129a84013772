"""The scheduler core: pure Python, standard library only (a test enforces it)."""
