"""Cache memory: what a generation's cache holds, a budget, low-precision storage, estimates before the run."""
