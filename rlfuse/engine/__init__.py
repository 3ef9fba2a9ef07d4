"""rlfuse.engine layer (see DEVELOPERS layout)."""
