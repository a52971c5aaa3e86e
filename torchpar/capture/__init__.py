"""Capture: torch objects (model, batch, optimizer) → the IR and optimizer spec."""
