"""The recipes ``relax init`` copies: one folder per recipe, holding its ``cluster.toml`` and
the files it imports. Installed as the package ``relax.examples`` (see setup.py), so
``relax init`` finds them in a wheel through ``importlib.resources``."""
