"""Spawned calls: their records, webhooks, schedules, and what each caller saw."""
