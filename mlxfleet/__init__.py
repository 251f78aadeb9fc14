"""mlxfleet: serve local LLMs with MLX from YAML manifests."""

__version__ = "0.1.0"
