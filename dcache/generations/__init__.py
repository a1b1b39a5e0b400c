"""Generations: tracking them through the scheduler, their records, what they cost and what they did."""
