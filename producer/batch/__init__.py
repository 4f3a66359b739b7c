"""Offline batch jobs through RQ: a JSONL file of requests in, completions out."""
