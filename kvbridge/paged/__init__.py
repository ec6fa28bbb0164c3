"""kvbridge.paged."""
