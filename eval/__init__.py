"""Evaluation: metrics, timing, runners, reports and plots."""
