"""Capacity planning: a fleet model of draft and target pools (SimPy) over measured costs,
and a planner that turns it into replica ratios, a speculation setting and autoscaler
bounds (docs/capacity.md). Nothing in production imports it."""
