"""The OpenAI-compatible HTTP front door (``pdkv serve``, ``pdkv frontend``)."""

from deploy.http.app import FrontDoor, create_app
from deploy.http.server import bind, run_frontend

__all__ = ["FrontDoor", "bind", "create_app", "run_frontend"]
