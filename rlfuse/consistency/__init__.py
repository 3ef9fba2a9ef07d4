"""Rollout against trainer: log-prob mismatch metrics, per-op drift localisation and the `rlfuse check` sweep."""
