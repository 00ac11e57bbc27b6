"""Patching third-party models to use sptr's kernels."""
