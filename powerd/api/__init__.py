"""The admin API (REST, served by the controller) and its command-line client.

`powerd.api.app` (FastAPI, the controller) and `powerd.api.server` are imported by whoever
serves the API; the command-line client (`powerd.api.client`) must not pay for them.
"""
