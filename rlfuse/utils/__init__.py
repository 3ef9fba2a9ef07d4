"""Plain-Python helpers below every layer (no torch): importing users' functions and running them in a worker."""
