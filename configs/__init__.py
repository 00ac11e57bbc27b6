"""The YAML configs, installed as the package ``sptr.configs`` (see sptr/config_files.py)."""
