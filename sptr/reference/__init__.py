"""Readable pure-PyTorch implementations: the specification the kernels are tested against."""
