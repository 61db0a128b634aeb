"""The admin API (REST, served by the controller) and its command-line client."""

from powerd.api.app import create_app
from powerd.api.server import ApiServer, serve_api

__all__ = ["ApiServer", "create_app", "serve_api"]
