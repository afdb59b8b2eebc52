"""Celery workers: one process per pool (`tangram worker cpu|api|gpu`)."""
