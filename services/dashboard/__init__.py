"""The dashboard served at ``/``: cluster, queues, jobs and events pages over the API (docs/dashboard.md)."""

from services.dashboard.router import dashboard_router

__all__ = ["dashboard_router"]
