"""Relax: asynchronous RL post-training on supervised asyncio actors and a versioned sample bus."""

__version__ = "0.1.0"
