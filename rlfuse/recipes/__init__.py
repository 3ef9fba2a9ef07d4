"""rlfuse.recipes layer (see DEVELOPERS layout)."""
