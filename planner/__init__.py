"""Ratio tuning: fit a performance model from probe measurements, simulate prefill/decode
splits, and search the split with the most goodput (see README.md here)."""
