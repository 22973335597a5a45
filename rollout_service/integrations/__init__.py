"""Integrations with third-party trainers (imported on demand: `from rollout_service.integrations import trl`)."""
