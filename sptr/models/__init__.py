"""Assembled networks built from sptr layers."""
