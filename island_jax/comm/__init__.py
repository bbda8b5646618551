"""Transports between islands and the coordinator."""
