"""Combine accuracy per wire format on synthetic expert outputs: no server, no weights, CPU or GPU."""
