"""Across processes: process groups (parallel_state), the collectives models call (collectives), the step
protocol between data-parallel ranks (step_sync), expert placement and load balancing (eplb) and the
worker processes a front end drives (executor). docs/parallelism.md describes the layout."""
