"""The example FastAPI gateway: see app.py."""

from .app import create_app

__all__ = ["create_app"]
