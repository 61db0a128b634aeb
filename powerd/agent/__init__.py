"""The node agent: reports GPU telemetry, applies caps, falls back to failsafe caps alone."""

from powerd.agent.agent import Agent, build_backend, build_transport, run_agent
from powerd.agent.settings import AgentSettings, SettingsError

__all__ = [
    "Agent",
    "AgentSettings",
    "SettingsError",
    "build_backend",
    "build_transport",
    "run_agent",
]
