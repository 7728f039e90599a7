"""pagedserve's release, as pyproject.toml states it: the gateway's GET /version and `pagedserve.__version__`."""

__version__ = "0.1.0"
