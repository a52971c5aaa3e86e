"""Planner: IR → Plan (layers, stages, shardings)."""
