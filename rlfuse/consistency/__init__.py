"""rlfuse.consistency layer (see DEVELOPERS layout)."""
