"""rlfuse.train layer (see DEVELOPERS layout)."""
