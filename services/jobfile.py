"""Kept for its importers: job files are read by the services.jobfiles package."""

from services.jobfiles import JobFileError, load_job_file

__all__ = ["JobFileError", "load_job_file"]
