"""kvbridge.engine."""
