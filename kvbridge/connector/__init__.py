"""kvbridge.connector."""
