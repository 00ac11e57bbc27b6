"""The YAML files shipped in ``configs/``: found in a checkout, or in the installed package ``sptr.configs``
(setup.py installs the folder under that name, so a non-editable install has them too)."""
from __future__ import annotations

import os


def config_dir() -> str:
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    if os.path.isdir(checkout):
        return checkout
    from importlib import resources

    return str(resources.files("sptr.configs"))


def config_path(name: str) -> str:
    """``name`` itself if it is a file, else the shipped config of that name (``sphereformer_semantickitti``,
    with or without ``.yaml``; ``labels/semantickitti``)."""
    if os.path.isfile(name):
        return name
    shipped = os.path.join(config_dir(), name if name.endswith(".yaml") else f"{name}.yaml")
    if os.path.isfile(shipped):
        return shipped
    known = sorted(f[:-5] for f in os.listdir(config_dir()) if f.endswith(".yaml"))
    raise FileNotFoundError(f"config {name!r} is neither a file nor a shipped config ({', '.join(known)})")
