"""Spawned calls: their records, webhooks, schedules, spans, and what each caller saw."""
